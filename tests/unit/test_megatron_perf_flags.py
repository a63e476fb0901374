"""The reference scripts' Megatron and optimizer flags (issue 19, point 4), without a Megatron-LM checkout:
declared with Megatron-LM's / slime's names, types, defaults and choices; ``--optimizer sgd`` trains with SGD;
the kernel, fusion, offload and memory flags are accepted and said once at start-up (vime/config/megatron_perf.py).
The Megatron backend's side (SGD, --moe-router-dtype, --attention-backend) is in test_megatron_perf_backend.py."""

import pytest
import torch

from tests.train_args import minimal_train_argv as base
from vime.backends.torch_backend import TorchTrainerSpec, make_optimizer
from vime.config import ConfigError, parse_train_args
from vime.config.algorithm import AlgorithmConfig
from vime.config.roles import RoleOverrides

# OPTIMIZER_ARGS and MISC_ARGS as the reference's scripts/run-qwen3-4B.sh (and most others) pass them.
REFERENCE_ARGS = [
    "--optimizer",
    "adam",
    "--lr",
    "1e-6",
    "--weight-decay",
    "0.1",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.98",
    "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer",
    "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32",
    "--attention-backend",
    "flash",
    "--train-memory-margin-bytes",
    "3221225472",
]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_the_reference_scripts_flags_parse(model_dir):
    s = parse_train_args(base(model_dir, *REFERENCE_ARGS))
    assert s.train.optimizer == "adam" and s.train.weight_decay == 0.1
    assert s.perf.optimizer_cpu_offload and s.perf.overlap_cpu_optimizer_d2h_h2d
    assert s.perf.use_precision_aware_optimizer and s.perf.accumulate_allreduce_grads_in_fp32
    assert s.perf.attention_softmax_in_fp32 and s.perf.attention_backend == "flash"
    assert s.perf.train_memory_margin_bytes == 3 * 1024**3
    assert not s.megatron_lm.values  # vime's own flags, not passed through to a Megatron-LM checkout
    s = parse_train_args(
        base(
            model_dir,
            "--no-rope-fusion",
            "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion",
            "--moe-router-dtype",
            "fp32",
            "--megatron-to-hf-mode",
            "bridge",
        )
    )
    assert s.perf.no_rope_fusion and s.perf.no_bias_dropout_fusion and s.perf.moe_router_dtype == "fp32"
    assert s.perf.megatron_to_hf_mode == "bridge"


def test_defaults_are_the_references(model_dir):
    s = parse_train_args(base(model_dir))
    assert (s.train.optimizer, s.train.sgd_momentum) == ("adam", 0.9)  # Megatron-LM's
    assert s.perf.attention_backend == "auto" and s.perf.moe_router_dtype is None  # megatron-core's
    assert s.perf.optimizer_offload_fraction == 1.0 and not s.perf.optimizer_cpu_offload
    assert s.perf.train_memory_margin_bytes == 1024**3 and s.perf.megatron_to_hf_mode == "raw"  # slime's
    # Megatron-LM's --no-*-fusion flags store False into these destinations of args, True when left out.
    a = s.args
    assert a.apply_rope_fusion and a.gradient_accumulation_fusion and a.masked_softmax_fusion and a.bias_dropout_fusion
    a = parse_train_args(base(model_dir, "--no-rope-fusion", "--no-masked-softmax-fusion")).args
    assert not a.apply_rope_fusion and not a.masked_softmax_fusion and a.bias_dropout_fusion


def test_bad_values_are_refused_naming_the_flag(model_dir, capsys):
    with pytest.raises(ConfigError, match=r"^--optimizer: 'muon' .* not implemented in vime"):
        parse_train_args(base(model_dir, "--optimizer", "muon"))
    with pytest.raises(ConfigError, match="^--optimizer-cpu-offload: must be used with --use-precision-aware"):
        parse_train_args(base(model_dir, "--optimizer-cpu-offload"))
    with pytest.raises(ConfigError, match="^--optimizer-offload-fraction: must be in"):
        offload = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
        parse_train_args(base(model_dir, *offload, "--optimizer-offload-fraction", "2"))
    with pytest.raises(ConfigError, match="^--train-memory-margin-bytes: must be >= 0"):
        parse_train_args(base(model_dir, "--train-memory-margin-bytes", "-1"))
    with pytest.raises(ConfigError, match="^--sgd-momentum: must be >= 0"):
        parse_train_args(base(model_dir, "--optimizer", "sgd", "--sgd-momentum", "-0.5"))
    for flag, value in (("--attention-backend", "triton"), ("--moe-router-dtype", "bf16"), ("--optimizer", "lion")):
        with pytest.raises(SystemExit):
            parse_train_args(base(model_dir, flag, value))
        assert "invalid choice" in capsys.readouterr().err


def _spec(optimizer: str, **kw) -> TorchTrainerSpec:
    return TorchTrainerSpec(
        hf_checkpoint="unused",
        lr=0.1,
        weight_decay=kw.pop("weight_decay", 0.0),
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=1,
        global_batch_size=1,
        n_samples_per_prompt=1,
        rollout_temperature=1.0,
        algorithm=AlgorithmConfig(),
        seed=0,
        optimizer=optimizer,
        **kw,
    )


def test_optimizer_sgd_steps_with_momentum_and_l2_weight_decay():
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = make_optimizer([param], _spec("sgd", sgd_momentum=0.5, weight_decay=0.1), RoleOverrides("actor"))
    assert isinstance(opt, torch.optim.SGD)
    grad = torch.tensor([0.2, 0.4])
    expected, velocity = param.detach().clone(), torch.zeros(2)
    for _ in range(3):  # SGD with momentum: v = m v + (g + wd p); p -= lr v
        param.grad = grad.clone()
        opt.step()
        velocity = 0.5 * velocity + grad + 0.1 * expected if velocity.any() else grad + 0.1 * expected
        expected = expected - 0.1 * velocity
    torch.testing.assert_close(param.detach(), expected)
    # The default stays AdamW, and a role's lr still overrides the command line's.
    opt = make_optimizer([param], _spec("adam"), RoleOverrides("critic", values={"lr": 0.01}))
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 0.01
    opt = make_optimizer([param], _spec("sgd"), RoleOverrides("critic", values={"lr": 0.01}))
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["momentum"] == 0.9


def test_the_trainer_receives_the_optimizer(model_dir, tmp_path):
    from vime.queue.rollout_queue import StoreOptions
    from vime.workers.trainer_worker import TrainerWorkerSpec

    s = parse_train_args(base(model_dir, "--optimizer", "sgd", "--sgd-momentum", "0.7"))
    spec = TrainerWorkerSpec.from_settings(
        s, transport="object-store", store=StoreOptions(str(tmp_path)), threads=1, cpu_affinity=None
    )
    assert (spec.backend.optimizer, spec.backend.sgd_momentum) == ("sgd", 0.7)


def test_each_flag_is_said_once_at_start_up_with_what_it_does_on_the_backend(model_dir):
    from vime.preflight import report_megatron_perf_flags

    flags = [
        *REFERENCE_ARGS,
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--moe-router-dtype",
        "fp64",
        "--megatron-to-hf-mode",
        "bridge",
    ]
    said: list[str] = []
    s = parse_train_args(base(model_dir, *flags))
    report_megatron_perf_flags(s, said.append)
    given = [f for f in flags if f.startswith("--") and f not in ("--optimizer", "--lr", "--weight-decay")]
    given = [f for f in given if not f.startswith("--adam")]
    for flag in given:  # every flag given is named at the head of exactly one line
        assert sum(flag in {word.strip(",") for word in line.split(":")[0].split()} for line in said) == 1, flag
    text = "\n".join(said)
    assert "--attention-backend flash: no effect on the torch backend" in text
    assert "--moe-router-dtype fp64: no effect on the torch backend" in text
    assert "--accumulate-allreduce-grads-in-fp32: already vime's behaviour" in text
    assert "--no-rope-fusion, --no-gradient-accumulation-fusion: vime's Megatron backend never uses" in text
    assert "--train-memory-margin-bytes 3221225472: vime reserves no margin" in text

    notes = s.perf.startup_notes("megatron")
    assert any(n.startswith("--attention-backend flash: Transformer Engine's kernel") for n in notes)
    assert any(
        n.startswith("--moe-router-dtype fp64: the Megatron backend's MoE routers compute in float64") for n in notes
    )
    assert any(n.startswith("--attention-softmax-in-fp32: the Megatron backend's attention") for n in notes)
    # Left at their defaults the flags say nothing.
    assert parse_train_args(base(model_dir)).perf.startup_notes("megatron") == []


def test_flash_attention_and_permute_fusion_flags_say_what_they_do(model_dir):
    """Megatron-LM's --use-flash-attn is its older spelling of --attention-backend flash; --moe-permute-fusion asks
    for a fused kernel vime's Megatron backend does not build."""
    pytest.importorskip("megatron.core")
    s = parse_train_args(base(model_dir, "--use-flash-attn", "--moe-permute-fusion"))
    assert s.perf.effective_attention_backend() == "flash"
    from megatron.core.transformer.enums import AttnBackend

    assert s.perf.transformer_fields()["attention_backend"] == AttnBackend.flash
    megatron = s.perf.startup_notes("megatron")
    assert "--use-flash-attn: taken as --attention-backend flash" in megatron
    assert any(n.startswith("--moe-permute-fusion: vime's Megatron backend builds") for n in megatron)
    torch_notes = s.perf.startup_notes("torch")
    assert "--use-flash-attn: no effect on the torch backend, which runs HF's attention" in torch_notes
    # An explicit --attention-backend decides.
    told = parse_train_args(base(model_dir, "--use-flash-attn", "--attention-backend", "fused"))
    assert told.perf.effective_attention_backend() == "fused"
    assert "--use-flash-attn: --attention-backend fused decides the kernel" in told.perf.startup_notes("megatron")


def test_position_embedding_flags_are_checked(model_dir, tmp_path):
    """The reference's presets say --position-embedding-type rope and --rotary-percent (1.0, or a partial rotary
    factor): rope is what vime's models take, and the fraction must be config.json's."""
    from transformers import Glm4Config, Qwen2Config

    s = parse_train_args(base(model_dir, "--position-embedding-type", "rope", "--rotary-percent", "1.0"))
    s.megatron.check_against_hf(Qwen2Config(), "torch")  # no partial_rotary_factor: 1.0
    with pytest.raises(ConfigError, match="^--rotary-percent: 1.0 disagrees with .*partial_rotary_factor 0.5"):
        s.megatron.check_against_hf(Glm4Config(), "torch")
    parse_train_args(base(model_dir, "--rotary-percent", "0.5")).megatron.check_against_hf(Glm4Config(), "torch")
    with pytest.raises(ConfigError, match="^--position-embedding-type: 'yarn': vime's models take rotary"):
        parse_train_args(base(model_dir, "--position-embedding-type", "yarn"))
    with pytest.raises(ConfigError, match="^--rotary-percent: must be in \\(0, 1\\], got 0.0"):
        parse_train_args(base(model_dir, "--rotary-percent", "0"))


def test_other_reference_preset_flags(model_dir):
    """--max-position-embeddings is checked against config.json; --moe-token-drop-policy only matters with a capacity
    factor (vime's MoE is dropless); --seq-length is said not to be read; --rollout-backend names vLLM."""
    from transformers import Qwen2Config

    s = parse_train_args(
        base(
            model_dir,
            *("--max-position-embeddings", "32768", "--moe-token-drop-policy", "probs"),
            *("--seq-length", "4096", "--rollout-backend", "vllm"),
        )
    )
    s.megatron.check_against_hf(Qwen2Config(max_position_embeddings=32768), "torch")
    with pytest.raises(ConfigError, match="^--max-position-embeddings: 32768 disagrees with .*config.json \\(4096\\)"):
        s.megatron.check_against_hf(Qwen2Config(max_position_embeddings=4096), "torch")
    assert any(n.startswith("--seq-length 4096: not read") for n in s.perf.startup_notes("megatron"))
    with pytest.raises(ConfigError, match="^--rollout-backend: 'sglang': vime's engines are vLLM's"):
        parse_train_args(base(model_dir, "--rollout-backend", "sglang"))
    with pytest.raises(SystemExit):
        parse_train_args(base(model_dir, "--moe-token-drop-policy", "random"))


def test_data_pad_size_multiplier_reaches_the_megatron_spec_and_is_said_on_the_torch_backend(model_dir):
    """The reference's GLM-5 scripts pass it (1024, 4096); the Megatron backend pads with it
    (test_megatron_model.py checks the logits do not change); the torch backend says it does not read it."""
    s = parse_train_args(base(model_dir, "--data-pad-size-multiplier", "1024"))
    assert s.perf.data_pad_size_multiplier == 1024
    assert s.perf.startup_notes("torch") == [
        "--data-pad-size-multiplier 1024: no effect on the torch backend, which pads nothing for kernel alignment; "
        "the Megatron backend pads its micro-batches with it"
    ]
    assert s.perf.startup_notes("megatron") == []
    assert parse_train_args(base(model_dir)).perf.data_pad_size_multiplier is None  # vime pads only what it needs
    with pytest.raises(ConfigError, match=r"^--data-pad-size-multiplier: must be >= 1 \(tokens\), got 0"):
        parse_train_args(base(model_dir, "--data-pad-size-multiplier", "0"))


def test_model_name_must_pick_the_converter_config_json_would(model_dir):
    """--model-name (the reference's name for its Megatron-to-HF converter): a name that picks the converter of
    config.json's own class passes; another model's, or one the reference has no converter for, is refused naming
    the flag. Said at start-up on both backends (the torch backend does not read it)."""
    from transformers import Glm4Config, Qwen2Config, Qwen3MoeConfig

    from vime.config.megatron_perf import MegatronPerfConfig, reference_converter

    s = parse_train_args(base(model_dir, "--model-name", "qwen2.5-0.5B"))
    assert s.perf.model_name == "qwen2.5-0.5B" and s.args.model_name == "qwen2.5-0.5B"
    assert any(
        n.startswith("--model-name qwen2.5-0.5B: not read by the torch backend") for n in s.perf.startup_notes("torch")
    )
    assert any(n.startswith("--model-name qwen2.5-0.5B: names the model") for n in s.perf.startup_notes("megatron"))
    assert reference_converter("Qwen3-4B") == reference_converter("Qwen2Config") == "Qwen"
    for name, config in (("qwen3-4B", Qwen2Config()), ("qwen3_moe", Qwen3MoeConfig()), ("GLM4", Glm4Config())):
        MegatronPerfConfig(model_name=name).check_model_name(config)
    MegatronPerfConfig().check_model_name(Glm4Config())  # left out: nothing to check
    with pytest.raises(ConfigError, match=r"^--model-name: 'glm4-9B' picks the GLM-4 converter, .*Qwen2Config.*Qwen$"):
        MegatronPerfConfig(model_name="glm4-9B").check_model_name(Qwen2Config())
    with pytest.raises(ConfigError, match=r"^--model-name: 'qwen3' picks the Qwen converter, .*is a Qwen-MoE$"):
        MegatronPerfConfig(model_name="qwen3").check_model_name(Qwen3MoeConfig())
    with pytest.raises(ConfigError, match=r"^--model-name: 'mixtral' names no model the reference converts"):
        MegatronPerfConfig(model_name="mixtral").check_model_name(Qwen2Config())
