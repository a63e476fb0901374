"""The reference framework's module paths resolve to vime's own implementations (issue 19, point 7)."""

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import parse_train_args
from vime.runtime.plugins import load_hook


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize(
    "path",
    ["vime.rollout.fully_async_rollout.generate_rollout_fully_async", "vime.rollout.vllm_rollout.generate_rollout"],
)
def test_the_references_rollout_names_select_the_built_in_rollout(model_dir, path):
    assert load_hook("--rollout-function-path", path) is not None  # imports and has the hook's signature
    s = parse_train_args(base(model_dir, "--rollout-function-path", path, "--eval-function-path", path))
    # None is vime's built-in fully-async rollout (and evaluation): exactly as without the flag.
    assert s.rollout.rollout_function_path is None and s.eval.eval_function_path is None
    assert parse_train_args(base(model_dir)).rollout.rollout_function_path is None
    from vime.rollout.fully_async_rollout import BuiltinRolloutCalled

    with pytest.raises(BuiltinRolloutCalled, match="stands for vime's built-in rollout"):
        load_hook("--rollout-function-path", path)(None, 0, None)


def test_the_references_filter_path_is_vimes_filter():
    from vime.rollout.filter_hub.base_types import DynamicFilterOutput
    from vime.rollout.filters import check_reward_nonzero_std
    from vime.sample import Sample

    path = "vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    hook = load_hook("--dynamic-sampling-filter-path", path)
    assert hook is check_reward_nonzero_std
    same = [Sample(reward=1.0), Sample(reward=1.0)]
    mixed = [Sample(reward=1.0), Sample(reward=0.0)]
    assert hook(None, same) == DynamicFilterOutput(keep=False, reason="zero_std_1.0")
    assert hook(None, mixed).keep is True


def test_the_references_sft_path_is_vimes_sft_rollout(model_dir):
    from vime.rollout.sft import generate_rollout

    path = "vime.rollout.sft_rollout.generate_rollout"
    assert load_hook("--rollout-function-path", path) is generate_rollout
    s = parse_train_args(base(model_dir, "--rollout-function-path", path))
    assert s.rollout.rollout_function_path == path  # a real rollout function: kept
