"""The reference framework's data and sample hooks (issue 19, point 5): --custom-config-path,
--apply-chat-template-kwargs, --multimodal-keys, --save-debug-train-data,
--custom-convert-samples-to-train-data-path (trained on the torch backend, a real optimizer step) and
--rollout-all-samples-process-path (called by the rollout worker on kept and filtered groups)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
import torch

from tests.train_args import minimal_train_argv
from vime.config import ConfigError, parse_train_args
from vime.config.hooks import HooksConfig
from vime.data.prompt import render_prompt, sft_tokens
from vime.runtime.plugins import PluginError, load_hook
from vime.sample import Sample


def parse(config_dir, *extra):
    return parse_train_args(minimal_train_argv(config_dir, *extra))


# ---------------------------------------------------------------------- --custom-config-path
def test_custom_config_keys_reach_args_and_override_flags(config_dir, tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("my_threshold: 0.25\nlr: 0.5\nmy_list: [1, 2]\n")
    s = parse(config_dir, "--custom-config-path", str(path))
    assert s.args.my_threshold == 0.25 and s.args.my_list == [1, 2]
    assert s.train.lr == 0.5  # a flag's name overrides the flag, before the sections are built
    notes = []
    from vime.preflight import report_hook_flags

    report_hook_flags(s, notes.append)
    assert notes == [f"--custom-config-path {path}: lr: 0.5 overrides --lr"]


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        ("- 1\n- 2\n", "expected a mapping of argument names to values, got list"),
        ("a: [1\n", "not valid YAML"),
    ],
)
def test_a_bad_custom_config_names_the_flag_and_the_path(config_dir, tmp_path, content, match):
    path = tmp_path / "custom.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as error:
        parse(config_dir, "--custom-config-path", str(path))
    assert error.value.flag == "--custom-config-path" and str(path) in str(error.value)


# ---------------------------------------------------------------------- data flags
class TemplateTokenizer:
    """A tokenizer whose chat template renders one token per message and records the template's kwargs."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.kwargs = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        """A user turn is [len(content)], an assistant turn [9, thinking, len(content)], the generation prompt
        [9, thinking] (thinking: 0 with enable_thinking=False)."""
        self.kwargs.append(kwargs)
        header = [9, 1 if kwargs.get("enable_thinking", True) else 0]
        tokens = []
        for m in messages:
            tokens += (header if m["role"] == "assistant" else []) + [len(m["content"])]
        return tokens + (header if add_generation_prompt else [])


def test_apply_chat_template_kwargs_reach_the_template(config_dir):
    s = parse(config_dir, "--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}')
    assert s.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert s.args.apply_chat_template_kwargs == {"enable_thinking": False}
    tokenizer = TemplateTokenizer()
    tokens = render_prompt(
        tokenizer, "abc", apply_chat_template=True, chat_template_kwargs=s.data.apply_chat_template_kwargs
    )
    assert tokens == [3, 9, 0] and tokenizer.kwargs == [{"enable_thinking": False}]
    assert render_prompt(TemplateTokenizer(), "abc", apply_chat_template=True) == [3, 9, 1]
    tokenizer = TemplateTokenizer()
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    tokens, response_length, loss_mask = sft_tokens(tokenizer, messages, {"enable_thinking": False})
    assert tokens == [1, 9, 0, 6] and response_length == 1 and loss_mask == [1]
    assert tokenizer.kwargs and all(k == {"enable_thinking": False} for k in tokenizer.kwargs)
    assert parse(config_dir).data.apply_chat_template_kwargs == {}


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--apply-chat-template-kwargs", "{not json", "not valid JSON"),
        ("--apply-chat-template-kwargs", "[1]", "expected a JSON object, got list"),
        ("--multimodal-keys", '"image"', "expected a JSON object, got str"),
    ],
)
def test_json_flags_refuse_what_is_not_a_json_object(config_dir, capsys, flag, value, message):
    with pytest.raises(SystemExit):
        parse(config_dir, flag, value)
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


def test_multimodal_keys_are_accepted_and_said_to_be_text_only(config_dir):
    s = parse(config_dir, "--multimodal-keys", '{"image": "image_file"}')
    assert s.data.multimodal_keys == {"image": "image_file"} and s.args.multimodal_keys == {"image": "image_file"}
    from vime.preflight import report_hook_flags

    notes = []
    report_hook_flags(s, notes.append)
    assert len(notes) == 1 and notes[0].startswith('--multimodal-keys {"image": "image_file"}: vime')
    assert "text-only" in notes[0]
    with pytest.raises(ConfigError, match="'image' must map to a record field name") as error:
        parse(config_dir, "--multimodal-keys", '{"image": 3}')
    assert error.value.flag == "--multimodal-keys"


# ---------------------------------------------------------------------- --save-debug-train-data
def test_the_debug_train_data_template_takes_rollout_id_and_rank_only(config_dir):
    s = parse(config_dir, "--save-debug-train-data", "/tmp/dbg/{rollout_id}_{rank}.pt")
    assert s.hooks.save_debug_train_data == "/tmp/dbg/{rollout_id}_{rank}.pt"
    from vime.preflight import written_directories

    assert ("--save-debug-train-data", "/tmp/dbg") in written_directories(s)
    with pytest.raises(ConfigError, match=r"unknown placeholder\(s\) \{step\}") as error:
        parse(config_dir, "--save-debug-train-data", "/tmp/dbg/{step}.pt")
    assert error.value.flag == "--save-debug-train-data"


def test_convert_with_custom_reward_post_process_is_refused(config_dir):
    with pytest.raises(ConfigError) as error:
        parse(
            config_dir,
            "--custom-convert-samples-to-train-data-path",
            "tests.plugins.objective_hooks.convert_samples",
            "--custom-reward-post-process-path",
            "m.f",
        )
    assert error.value.flag == "--custom-reward-post-process-path"


# ---------------------------------------------------------------------- trained on the torch backend
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("hooks_tiny")), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64
    )


def tiny_samples():
    samples = []
    for i in range(4):
        response = [3 + i, 4, 5, 6][: 2 + i % 3]
        samples.append(
            Sample(
                group_index=i // 2,
                index=i % 2,
                tokens=[1, 2, 7] + response,
                response_length=len(response),
                loss_mask=[1] * len(response),
                reward=float(i % 2) + 0.25 * i,
                rollout_log_probs=[-2.0] * len(response),
                weight_versions=[0] * len(response),
                status=Sample.Status.COMPLETED,
            )
        )
    return samples


def test_convert_and_debug_train_data_on_the_torch_backend(model_dir, tmp_path):
    from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
    from vime.config.algorithm import AlgorithmConfig
    from workers.trainer_worker import TrainerWorker

    hooks = HooksConfig(
        custom_convert_samples_to_train_data_path="tests.plugins.objective_hooks.convert_samples",
        save_debug_train_data=str(tmp_path / "debug" / "train_{rollout_id}_{rank}.pt"),
    )
    spec = TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=1e-3,
        weight_decay=0.0,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=2,
        global_batch_size=4,
        n_samples_per_prompt=2,
        rollout_temperature=1.0,
        algorithm=AlgorithmConfig(disable_rewards_normalization=True),
        seed=0,
        threads=1,
        hooks=hooks,
        custom_config={"my_threshold": 0.5},
    )
    backend = TorchBackend(spec)
    samples = tiny_samples()
    before = [p.detach().clone() for p in backend.model.parameters()]
    metrics = backend.train_rollout(samples, 0)
    assert metrics["optimizer_steps"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, backend.model.parameters()))
    data = backend.last_train_data
    # The conversion's rewards (negated) are what trained: they are the grpo advantages as they are.
    assert data["rewards"] == [-s.reward for s in samples]
    for advantages, sample in zip(data["advantages"], samples):
        assert torch.allclose(advantages, -sample.reward * torch.ones(sample.response_length))
    assert data["ref_log_probs"] is None and data["returns"] is None and len(data["log_probs"]) == 4
    assert backend.objective.hook_args.my_threshold == 0.5
    worker = types.SimpleNamespace(spec=types.SimpleNamespace(backend=spec), backend=backend, rank=0)
    TrainerWorker._save_debug_train_data(worker, 7)
    saved = torch.load(tmp_path / "debug" / "train_7_0.pt", weights_only=False)
    assert saved["rollout_id"] == 7 and saved["tokens"] == [s.tokens for s in samples]
    worker.rank = 1  # only rank 0 writes
    TrainerWorker._save_debug_train_data(worker, 8)
    assert not (tmp_path / "debug" / "train_8_1.pt").exists()


# ---------------------------------------------------------------------- --rollout-all-samples-process-path
PROCESS = """
SEEN = []

def process(args, all_samples, data_source):
    SEEN.append((args.tag, [[s.index for s in group] for group in all_samples], data_source))

def two(args, all_samples):
    pass
"""


def test_all_samples_process_sees_kept_and_filtered_groups(tmp_path):
    from workers.rollout_worker import ALL_SAMPLES_FLAG, RolloutWorker

    path = tmp_path / "process_hooks.py"
    path.write_text(PROCESS)
    process = load_hook(ALL_SAMPLES_FLAG, f"{path}:process")
    with pytest.raises(PluginError, match=rf"{ALL_SAMPLES_FLAG} {path}:two: its parameters \(args, all_samples\)"):
        load_hook(ALL_SAMPLES_FLAG, f"{path}:two")

    rejected = []

    async def reject(item, reason):
        rejected.append(reason)

    worker = types.SimpleNamespace(
        spec=types.SimpleNamespace(args=types.SimpleNamespace(tag="run"), dynamic_sampling_filter_path="f"),
        dynamic_filter=lambda args, samples: False,  # drops every group
        all_samples_process=process,
        _reject_group=reject,
        use_opd=False,
        reward=None,
    )
    samples = tiny_samples()[:2]
    for sample in samples:
        sample.response = "r"
    item = types.SimpleNamespace(assignment=types.SimpleNamespace(lease=None), version=0)
    asyncio.run(RolloutWorker._finish_group(worker, item, samples))
    assert rejected == ["filtered"]
    seen = process.__globals__["SEEN"]
    assert seen == [("run", [[0, 1]], None)]


def test_every_new_hook_flag_is_checked_at_start_up():
    from vime.preflight import HOOK_FLAGS

    flags = {flag for _, flag in HOOK_FLAGS}
    assert {
        "--custom-loss-function-path",
        "--custom-advantage-function-path",
        "--custom-pg-loss-reducer-function-path",
        "--custom-convert-samples-to-train-data-path",
        "--rollout-all-samples-process-path",
    } <= flags
    assert json.loads(json.dumps(sorted(flags)))  # plain strings
