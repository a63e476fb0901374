"""The reference's presets of models that only vime's torch backend trains (gpt-oss, Gemma 4, GLM-5): their
flags parse and agree with the checkpoint the preset describes, a preset given another checkpoint stops naming
the flag, the Megatron backend refuses them at start-up, and the torch backend takes a real training step on
each (a tiny random model of the same HF class, CPU)."""

import math

import pytest
import torch
from transformers import AutoConfig

from tests.train_args import minimal_train_argv as _args
from vime.config import ConfigError, parse_train_args
from vime.preflight import check_model_flags, report_megatron_perf_flags

# The reference's MODEL_ARGS (scripts/models/gpt-oss-20B.sh, gemma4-12B.sh, glm5-744B-A40B.sh), as data.
GPT_OSS_20B = """--spec vime_plugins.models.gpt_oss get_gpt_oss_spec --num-layers 24 --hidden-size 2880
--ffn-hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64
--seq-length 4096 --max-position-embeddings 131072 --padded-vocab-size 201088 --make-vocab-size-divisible-by 128
--tokenizer-type HuggingFaceTokenizer --bf16 --normalization RMSNorm --untie-embeddings-and-output-weights
--no-masked-softmax-fusion --no-rope-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --use-mcore-models
--rotary-percent 1.0 --rotary-base 150000 --position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32
--sequence-parallel --num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4 --moe-router-dtype fp32
--moe-router-score-function softmax --moe-router-load-balancing-type none --moe-aux-loss-coeff 0.0
--moe-token-dispatcher-type alltoall --moe-grouped-gemm --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable
--window-attn-skip-freq 2 --window-size 128,0 --activation-func-clamp-value 7.0""".split()
GEMMA4_12B = """--spec vime_plugins.models.gemma4 get_gemma4_spec
--custom-model-provider-path vime_plugins.models.gemma4_provider.model_provider --num-layers 48 --hidden-size 3840
--ffn-hidden-size 15360 --num-attention-heads 16 --group-query-attention --num-query-groups 8 --kv-channels 256
--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 10000 --rotary-percent 1.0 --vocab-size 262144 --qk-layernorm""".split()
GLM5 = """--spec vime_plugins.models.glm5.glm5 get_glm5_spec --moe-layer-freq [0]*3+[1]*75 --num-experts 256
--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-grouped-gemm --moe-permute-fusion
--moe-ffn-hidden-size 2048 --moe-router-score-function sigmoid --moe-router-pre-softmax
--moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0 --moe-router-dtype fp32 --make-vocab-size-divisible-by 16
--num-layers 78 --hidden-size 6144 --ffn-hidden-size 12288 --num-attention-heads 64 --disable-bias-linear --swiglu
--untie-embeddings-and-output-weights --position-embedding-type rope --no-position-embedding --normalization RMSNorm
--qk-layernorm --multi-latent-attention --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256
--kv-channels 192 --qk-pos-emb-head-dim 64 --vocab-size 154880 --rotary-base 1000000 --enable-experimental
--allgather-cp""".split()

# The checkpoints' config.json numbers (the presets' models; only the config is written, no weights).
GPT_OSS_20B_CONFIG = dict(num_hidden_layers=24, num_local_experts=32, layer_types=None)
GEMMA4_12B_TEXT = dict(
    num_hidden_layers=48,
    hidden_size=3840,
    intermediate_size=15360,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=262144,
)
GLM5_CONFIG = {}  # transformers' GlmMoeDsaConfig defaults are GLM-5's


def save_config(folder, model_type: str, **fields) -> str:
    if model_type == "gemma4":  # the multimodal checkpoint: its language model in text_config
        config = AutoConfig.for_model("gemma4", text_config=fields)
    else:
        config = AutoConfig.for_model(model_type, **fields)
    config.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    def folder(name):
        return tmp_path_factory.mktemp(name)

    return {
        "gpt_oss": save_config(folder("gpt_oss"), "gpt_oss", **GPT_OSS_20B_CONFIG),
        "gemma4": save_config(folder("gemma4"), "gemma4", **GEMMA4_12B_TEXT),
        "glm5": save_config(folder("glm5"), "glm_moe_dsa", **GLM5_CONFIG),
        "qwen3": save_config(folder("qwen3"), "qwen3", num_hidden_layers=2),
    }


PRESETS = {"gpt_oss": GPT_OSS_20B, "gemma4": GEMMA4_12B, "glm5": GLM5}
MEGATRON = ("--train-backend", "megatron", "--ray-address", "auto")  # (a cluster's GPUs: no local CUDA check)


def start_up_checks(settings, folder) -> None:
    """What vime.preflight checks of the model flags against config.json (check_inputs, without the data and the
    engines)."""
    check_model_flags(settings, AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_preset_passes_against_its_checkpoint_on_the_torch_backend(checkpoints, name):
    settings = parse_train_args(_args(checkpoints[name], "--train-backend", "torch", *PRESETS[name]))
    start_up_checks(settings, checkpoints[name])
    assert settings.megatron.names_torch_only_model()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_megatron_backend_refuses_them_at_start_up(checkpoints, name):
    settings = parse_train_args(_args(checkpoints[name], *MEGATRON, *PRESETS[name]))
    with pytest.raises(ConfigError, match="^--train-backend: megatron: vime's Megatron backend does not build"):
        start_up_checks(settings, checkpoints[name])


def test_by_default_a_gpu_machine_trains_them_with_the_torch_backend(checkpoints, monkeypatch):
    import vime.config as config

    monkeypatch.setattr(config, "default_train_backend", lambda: "megatron")  # as on a machine with CUDA GPUs
    monkeypatch.setattr(config, "check_local_cuda", lambda settings: None)
    assert parse_train_args(_args(checkpoints["qwen3"])).train.train_backend == "megatron"
    settings = parse_train_args(_args(checkpoints["gpt_oss"], *GPT_OSS_20B))
    assert settings.train.train_backend == "torch" and settings.backend_by_default
    from vime.preflight import report_train_backend

    said = []
    report_train_backend(settings, said.append)
    assert said == [
        "training backend: torch (the default for the model --spec names, which only the torch backend trains "
        "(HF's implementation))"
    ]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_given_another_checkpoint_stops_naming_its_spec(checkpoints, name):
    settings = parse_train_args(_args(checkpoints["qwen3"], "--train-backend", "torch", *PRESETS[name]))
    with pytest.raises(ConfigError, match=r"^--(spec|num-layers|hidden-size|custom-model-provider-path): "):
        start_up_checks(settings, checkpoints["qwen3"])
    spec_only = parse_train_args(_args(checkpoints["qwen3"], *PRESETS[name][:3]))
    with pytest.raises(ConfigError, match=r"^--spec: .* layers, but --hf-checkpoint's config.json is a qwen3$"):
        start_up_checks(spec_only, checkpoints["qwen3"])


def with_flag(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag``'s value(s) replaced (a switch: removed when no value is given)."""
    i = argv.index(flag)
    width = 1
    while i + width < len(argv) and not argv[i + width].startswith("--"):
        width += 1
    return argv[:i] + ([flag, *values] if values else []) + argv[i + width :]


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--window-size", "64,0", r"64,0 disagrees with --hf-checkpoint's config.json \(sliding_window 128\)"),
        ("--window-attn-skip-freq", "3", r"3 disagrees with --hf-checkpoint's config.json \(layer_types"),
        ("--activation-func-clamp-value", "5", r"5.0 disagrees with .*\(swiglu_limit 7.0\)"),
        ("--softmax-type", "vanilla", r"vanilla disagrees with --hf-checkpoint's gpt_oss, whose attention has learnt"),
        ("--glu-linear-offset", "0", r"0.0 disagrees with --hf-checkpoint's gpt_oss \(offset 1.0\)"),
        ("--padded-vocab-size", "201024", r"201024 disagrees with the torch backend's embedding table of 201088 rows"),
        ("--kv-channels", "128", r"128 disagrees with --hf-checkpoint's config.json \(64\)"),
    ],
)
def test_each_gpt_oss_flag_is_checked_against_config_json(checkpoints, flag, value, said):
    settings = parse_train_args(_args(checkpoints["gpt_oss"], *with_flag(GPT_OSS_20B, flag, value)))
    with pytest.raises(ConfigError, match=f"^{flag}: {said}"):
        start_up_checks(settings, checkpoints["gpt_oss"])


def test_gpt_oss_flags_on_a_model_without_those_features_are_refused(checkpoints, tmp_path):
    qwen3 = checkpoints["qwen3"]
    for extra, said in [
        (["--quick-geglu"], "^--quick-geglu: --hf-checkpoint's qwen3 does not compute the quick GeGLU"),
        (
            ["--activation-func-clamp-value", "7"],
            r"^--activation-func-clamp-value: 7.0 .*\(no clamp: no swiglu_limit\)",
        ),
        (["--window-size", "128,0"], r"^--window-size: 128,0 disagrees .*\(no sliding window\)"),
        (["--softmax-type", "learnable"], "^--softmax-type: learnable disagrees .* plain softmax \\(vanilla\\)"),
    ]:
        with pytest.raises(ConfigError, match=said):
            start_up_checks(parse_train_args(_args(qwen3, *extra)), qwen3)
    qwen2 = save_config(tmp_path, "qwen2", num_hidden_layers=2, sliding_window=8)
    with pytest.raises(ConfigError, match=r"^--window-size: 8,0 disagrees .*\(no sliding window\)"):
        start_up_checks(parse_train_args(_args(qwen2, "--window-size", "8,0")), qwen2)  # a window no layer uses
    # What a plain model does, stated, passes.
    plain = ["--softmax-type", "vanilla", "--glu-linear-offset", "0", "--tokenizer-type", "HuggingFaceTokenizer"]
    start_up_checks(parse_train_args(_args(qwen3, *plain)), qwen3)


def test_padded_vocab_size_on_the_megatron_backend_is_its_padded_table(checkpoints):
    qwen3 = checkpoints["qwen3"]
    vocab = AutoConfig.from_pretrained(qwen3).vocab_size
    padded = -(-vocab // 256) * 256  # --make-vocab-size-divisible-by 128 x --tensor-model-parallel-size 2
    common = (*MEGATRON, "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
    start_up_checks(parse_train_args(_args(qwen3, *common, "--padded-vocab-size", str(padded))), qwen3)
    with pytest.raises(ConfigError, match=f"^--padded-vocab-size: {vocab} disagrees with the megatron backend's"):
        start_up_checks(parse_train_args(_args(qwen3, *common, "--padded-vocab-size", str(vocab))), qwen3)


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--tokenizer-type", "GPT2BPETokenizer"], "^--tokenizer-type: 'GPT2BPETokenizer': vime tokenizes with"),
        (["--softmax-type", "off-by-one"], "^--softmax-type: off-by-one: no HF model vime trains"),
        (["--window-size", "128,4"], r"^--window-size: 128,4: HF's sliding windows are causal \(RIGHT 0\)"),
        (["--window-size", "128"], r"^--window-size: expected LEFT,RIGHT \(two integers, e.g. 128,0\), got '128'"),
        (["--window-attn-skip-freq", "0"], "^--window-attn-skip-freq: must be >= 1, got 0"),
        (["--padded-vocab-size", "0"], "^--padded-vocab-size: must be >= 1, got 0"),
        (["--custom-model-provider-path", "my.models.provider"], "^--custom-model-provider-path: my.models.provider: "),
        (["--allgather-cp", "--context-parallel-size", "2"], "^--allgather-cp: with --context-parallel-size 2: "),
    ],
)
def test_bad_values_are_refused_naming_the_flag(config_dir, extra, said):
    with pytest.raises(ConfigError, match=said):
        parse_train_args(_args(config_dir, *extra))


def test_the_no_op_flags_say_what_they_do(config_dir):
    s = parse_train_args(_args(config_dir, "--no-bias-gelu-fusion", "--enable-experimental", "--allgather-cp"))
    assert s.args.bias_gelu_fusion is False  # Megatron-LM's destination, for hooks
    notes = []
    report_megatron_perf_flags(s, notes.append)
    assert any(n.startswith("--no-bias-gelu-fusion: vime's Megatron backend never uses") for n in notes), notes
    assert (
        "--enable-experimental: no effect on the torch backend (megatron-core's experimental features are the "
        "Megatron backend's)" in notes
    )
    s = parse_train_args(_args(config_dir, *MEGATRON, "--enable-experimental"))
    notes = []
    report_megatron_perf_flags(s, notes.append)
    assert "--enable-experimental: megatron-core's experimental flag is set in the Megatron backend's trainers" in notes


# ------------------------------------------------------------------------------------------ a real training step
def tiny_model(folder, model_type: str) -> str:
    """A tiny random model of ``model_type``'s HF class, with vime's tiny character tokenizer."""
    from transformers import AutoModelForCausalLM

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    fields = {
        "gpt_oss": dict(
            common,
            intermediate_size=32,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        ),
        "gemma4_text": dict(
            common,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            vocab_size_per_layer_input=len(tokenizer),
            hidden_size_per_layer_input=8,
        ),
        "glm_moe_dsa": dict(
            common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            index_topk=4,
            first_k_dense_replace=1,
        ),
    }[model_type]
    if model_type == "gemma4_text":
        config = AutoConfig.for_model("gemma4", text_config=fields)
    else:
        config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text", "glm_moe_dsa"])
def test_the_torch_backend_trains_each(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    from tests.unit.test_rl_torch_backend import backend, make_samples

    folder = tiny_model(tmp_path, model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    trainer = backend(folder)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_rollout(make_samples(model), policy_version=0)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # The sampler's log-probs are the model's own (HF's forward): the trainer computes the same before its step.
    assert metrics["onpolicy_logprob_abs_diff"] < 1e-4


def test_a_model_whose_masks_ignore_the_position_ids_is_not_packed(tmp_path):
    """transformers' gpt-oss builds its masks without the position ids: packed, its sequences would see each
    other (the training test above then fails on the log-probs); the probe finds it, and passes the others."""
    from transformers import AutoModelForCausalLM

    from vime.backends.sequence_packing import packed_leak

    def loaded(model_type):
        return AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / model_type, model_type))

    gpt_oss = loaded("gpt_oss").train()
    assert packed_leak(gpt_oss) == (
        "GptOssForCausalLM attends across packed sequences (its attention masks do not follow the position ids)"
    )
    assert gpt_oss.training  # the probe runs in eval mode and restores the model's
    assert packed_leak(loaded("gemma4_text")) is None
