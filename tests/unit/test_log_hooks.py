"""--custom-rollout-log-function-path and --custom-eval-rollout-log-function-path (vime/runtime/log_hooks.py): what the
hooks are given, what vime makes of their answers, and the trackers' rows of the records they add to. The
hooks run inside a real `vime train` in tests/integration/test_data_hooks_run.py."""

from __future__ import annotations

import argparse

import pytest

from vime.errors import UserError
from vime.runtime.log_hooks import EvalLogHook, LogHookError, RolloutLogHook, hook_fields
from vime.runtime.plugins import PluginError
from vime.sample import Sample
from vime.tracking import row_of

HOOKS = """
CALLS = []

def log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    CALLS.append((rollout_id, args.tag, len(samples), rollout_time))
    rollout_extra_metrics["mine/count"] = len(samples)
    rollout_extra_metrics["mine/tensor"] = __import__("torch").tensor([0.5])  # a one-element tensor ...
    rollout_extra_metrics["mine/numpy"] = __import__("numpy").float32(0.25)  # ... and numpy's scalars are numbers
    rollout_extra_metrics["mine/flag"] = True
    return rollout_id % 2 == 1

def log_text(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    rollout_extra_metrics["mine/text"] = "3"

def log_vector(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    rollout_extra_metrics["mine/vector"] = __import__("numpy").zeros(3)

def log_raises(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    raise KeyError("no such field")

def log_eval(rollout_id, args, data, extra_metrics):
    extra_metrics.update({f"{name}/n": len(entry["rewards"]) for name, entry in data.items()})
    return None

def too_few(rollout_id, args, samples):
    pass
"""


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "log_hooks_plugin.py"
    path.write_text(HOOKS)
    return str(path)


def test_the_rollout_hook_gets_the_reference_arguments_and_its_numbers_are_kept(hooks):
    hook = RolloutLogHook(f"{hooks}:log", argparse.Namespace(tag="run"))
    samples = [Sample(reward=1.0), Sample(reward=0.0)]
    numbers = {"mine/count": 2.0, "mine/tensor": 0.5, "mine/numpy": 0.25, "mine/flag": 1.0}
    assert hook(0, samples, 2.5) == (numbers, False)
    assert hook(1, samples, 3.0) == (numbers, True)
    import sys

    assert sys.modules["vime_plugin_log_hooks_plugin"].CALLS == [(0, "run", 2, 2.5), (1, "run", 2, 3.0)]


@pytest.mark.parametrize(
    "name, message",
    [
        ("log_text", "metric 'mine/text' is a str, not a number"),
        ("log_vector", "metric 'mine/vector' is a ndarray, not a number"),
        ("log_raises", "raised KeyError: 'no such field'"),
    ],
)
def test_what_the_rollout_hook_cannot_log_stops_it_naming_the_flag(hooks, name, message):
    hook = RolloutLogHook(f"{hooks}:{name}", None)
    with pytest.raises(LogHookError, match=f"--custom-rollout-log-function-path {hooks}:{name}: ") as caught:
        hook(0, [Sample()], 0.0)
    assert message in str(caught.value)
    assert isinstance(caught.value, UserError)  # the run stops: a trainer restart would meet it again


def test_a_hook_whose_parameters_cannot_take_the_call_is_refused_when_loaded(hooks):
    with pytest.raises(PluginError, match="--custom-rollout-log-function-path .*do not accept vime's call log"):
        RolloutLogHook(f"{hooks}:too_few", None)
    with pytest.raises(PluginError, match="--custom-eval-rollout-log-function-path .*do not accept"):
        EvalLogHook(f"{hooks}:log", None)


def test_the_eval_hook_gets_every_set_s_data(hooks):
    hook = EvalLogHook(f"{hooks}:log_eval", None)
    data = {"a": {"rewards": [1.0, 0.0], "samples": []}, "b": {"rewards": [1.0], "samples": []}}
    assert hook(7, data) == ({"a/n": 2.0, "b/n": 1.0}, False)


def test_tracker_rows_name_the_hook_s_metrics_as_given_and_leave_out_what_it_logged_itself():
    record = {"kind": "train", "step": 3, "reward_mean": 0.5, "loss": 1.25, "reward_mean/easy": 1.0}
    assert row_of(record) == {"train/reward_mean": 0.5, "train/loss": 1.25, "train/reward_mean/easy": 1.0}
    logged = {**record, **hook_fields({"mine/x": 2.0}, True, defaults=["reward_mean", "reward_mean/easy"])}
    assert row_of(logged) == {"train/loss": 1.25, "mine/x": 2.0}
    kept = {**record, **hook_fields({"mine/x": 2.0}, False, defaults=["reward_mean"])}
    assert row_of(kept) == {**row_of(record), "mine/x": 2.0}
    # The evaluation's own record of the hook's numbers is no event.
    assert row_of({"kind": "eval_log", "step": 3, "user_metrics": {"held_out/n": 4.0}}) == {"held_out/n": 4.0}
    evaluated = {"kind": "eval", "step": 3, "dataset": "d", "eval_reward": 0.7, "untracked": ["eval_reward"]}
    assert row_of(evaluated) == {}
