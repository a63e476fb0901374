"""Flags of the reference's model presets and scripts that vime takes with their meaning, where the meaning is a
cross-check or a choice that changes no result here: --rotary-scaling-factor (checked against config.json's
RoPE scaling), --moe-token-dispatcher-type flex with --moe-enable-deepep (DeepEP's kernels where installed, else
alltoall), --loss-mask-type (SFT's turns located from the chat template) and --use-mcore-models."""

import pytest
from transformers import AutoConfig

from tests.megatron_shim import tiny_hf_model
from tests.train_args import minimal_train_argv as _args
from vime.backends import megatron_model as mm
from vime.backends.megatron_args import rope_scaling_factor
from vime.config import ConfigError, parse_train_args
from vime.preflight import report_hook_flags, report_megatron_perf_flags


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_hf_model(str(tmp_path_factory.mktemp("llama3")), "llama", rope_scaling=True)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_hf_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


# ---------------------------------------------------------------------------------------------- RoPE scaling
def test_rotary_scaling_factor_is_config_jsons(llama_dir, qwen_dir):
    assert rope_scaling_factor(AutoConfig.from_pretrained(llama_dir)) == 8.0  # Llama 3.x scaling
    assert rope_scaling_factor(AutoConfig.from_pretrained(qwen_dir)) == 1.0  # none
    # the reference's Llama 3.1 preset: --use-rope-scaling --rotary-scaling-factor 8.0
    s = parse_train_args(_args(llama_dir, "--use-rope-scaling", "--rotary-scaling-factor", "8.0"))
    s.megatron.check_against_hf(AutoConfig.from_pretrained(llama_dir), "megatron")
    parse_train_args(_args(qwen_dir, "--rotary-scaling-factor", "1")).megatron.check_against_hf(
        AutoConfig.from_pretrained(qwen_dir)
    )
    for folder, value, said in [(llama_dir, "4", "8.0"), (qwen_dir, "40", "1.0")]:
        s = parse_train_args(_args(folder, "--rotary-scaling-factor", value))
        with pytest.raises(ConfigError, match=f"^--rotary-scaling-factor: {value}.0 disagrees .*factor {said}"):
            s.megatron.check_against_hf(AutoConfig.from_pretrained(folder))
    with pytest.raises(ConfigError, match="^--rotary-scaling-factor: must be > 0"):
        parse_train_args(_args(qwen_dir, "--rotary-scaling-factor", "0"))


# ---------------------------------------------------------------------------------------------- flex and DeepEP
def test_flex_dispatch_uses_deepep_where_it_can_run_and_alltoall_elsewhere(qwen_dir, monkeypatch):
    s = parse_train_args(_args(qwen_dir, "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"))
    assert s.megatron.moe_token_dispatcher_type == "flex"
    assert not mm.deepep_usable()  # no CUDA, no deep_ep here
    assert mm.token_dispatcher("flex") == "alltoall"
    assert [mm.token_dispatcher(t) for t in ("allgather", "alltoall")] == ["allgather", "alltoall"]
    monkeypatch.setattr(mm, "deepep_usable", lambda: True)  # as on a GPU node with DeepEP installed
    assert mm.token_dispatcher("flex") == "flex"
    notes = []
    report_megatron_perf_flags(s, notes.append)
    assert any(n.startswith("--moe-token-dispatcher-type flex: no effect on the torch backend") for n in notes)


def test_deepep_needs_the_flex_dispatcher(qwen_dir):
    with pytest.raises(ConfigError, match="^--moe-enable-deepep: needs --moe-token-dispatcher-type flex"):
        parse_train_args(_args(qwen_dir, "--moe-enable-deepep"))


# ---------------------------------------------------------------------------------------------- SFT and no-ops
@pytest.mark.parametrize("kind", ["qwen", "qwen3", "qwen3_5", "distill_qwen", "gemma4"])
def test_loss_mask_type_is_accepted_and_said(qwen_dir, kind):
    s = parse_train_args(_args(qwen_dir, "--loss-type", "sft_loss", "--loss-mask-type", kind))
    assert s.algorithm.loss_mask_type == kind
    notes = []
    report_hook_flags(s, notes.append)
    assert notes == [
        f"--loss-mask-type {kind}: SFT's assistant turns are located from the tokenizer's own chat template, "
        "whatever the family (vime.data.prompt.sft_tokens)"
    ]


def test_an_unknown_loss_mask_type_is_refused(qwen_dir, capsys):
    with pytest.raises(SystemExit):
        parse_train_args(_args(qwen_dir, "--loss-mask-type", "llama"))
    assert "--loss-mask-type: invalid choice: 'llama'" in capsys.readouterr().err


def test_use_mcore_models_is_accepted(qwen_dir):
    assert parse_train_args(_args(qwen_dir, "--use-mcore-models")).megatron.use_mcore_models


# ---------------------------------------------------------------------------------------------- multi-token prediction
def test_mtp_num_layers_is_checked_against_config_json(qwen_dir, tmp_path):
    """--mtp-num-layers states the checkpoint's multi-token-prediction layers (carried unchanged, not built);
    training them is refused naming the flag, as is its loss weight without it."""
    from tests.megatron_shim import tiny_moe_hf_model

    glm_dir = tiny_moe_hf_model(str(tmp_path / "glm4_moe"), "glm4_moe", num_nextn_predict_layers=1)
    parse_train_args(_args(glm_dir, "--mtp-num-layers", "1")).megatron.check_against_hf(
        AutoConfig.from_pretrained(glm_dir)
    )
    for folder, value, declared in [(glm_dir, "2", 1), (qwen_dir, "1", 0)]:
        s = parse_train_args(_args(folder, "--mtp-num-layers", value))
        with pytest.raises(ConfigError, match=f"^--mtp-num-layers: {value} disagrees .*\\({declared} multi-token"):
            s.megatron.check_against_hf(AutoConfig.from_pretrained(folder))
    with pytest.raises(ConfigError, match="^--enable-mtp-training: training the multi-token-prediction layers is not"):
        parse_train_args(_args(glm_dir, "--mtp-num-layers", "1", "--enable-mtp-training"))
    with pytest.raises(ConfigError, match="^--mtp-loss-scaling-factor: is read only with --enable-mtp-training"):
        parse_train_args(_args(glm_dir, "--mtp-loss-scaling-factor", "0.2"))
    with pytest.raises(ConfigError, match="^--mtp-num-layers: must be >= 0, got -1"):
        parse_train_args(_args(glm_dir, "--mtp-num-layers", "-1"))
