"""`vime tools convert-hf-to-megatron` / `convert-megatron-to-hf` and the Megatron flags' start-up checks."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.megatron_shim import tiny_hf_model
from tests.train_args import minimal_train_argv as _args
from vime.backends.megatron_convert import read_hf_state_dict
from vime.config import ConfigError, parse_train_args


def _same_hf_weights(a: str, b: str) -> None:
    left, right = read_hf_state_dict(a), read_hf_state_dict(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)
def test_convert_torch_dist_in_a_fresh_process_and_back(tmp_path):
    pytest.importorskip("megatron.core")
    hf = tiny_hf_model(str(tmp_path / "hf"), "qwen3", tie=True)
    # A plain process (no test shim): the converters run on a CPU machine as they are.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime.cli",
            "tools",
            "convert-hf-to-megatron",
            "--hf-checkpoint",
            hf,
            "--save",
            str(tmp_path / "mcore"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text() == "0"
    step = tmp_path / "mcore" / "iter_0000000"
    assert (step / "metadata.json").exists() and any(n.endswith(".distcp") for n in os.listdir(step))

    from vime.cli import main

    assert (
        main(
            [
                "tools",
                "convert-megatron-to-hf",
                "--load",
                str(tmp_path / "mcore"),
                "--save",
                str(tmp_path / "back"),
                "--hf-config",
                hf,
            ]
        )
        == 0
    )
    _same_hf_weights(hf, str(tmp_path / "back"))
    assert (tmp_path / "back" / "config.json").exists()


def test_convert_torch_format_round_trip(tmp_path):
    from vime.cli import main

    hf = tiny_hf_model(str(tmp_path / "hf"), "llama", rope_scaling=True)
    assert (
        main(
            [
                "tools",
                "convert-hf-to-megatron",
                "--hf-checkpoint",
                hf,
                "--save",
                str(tmp_path / "mcore"),
                "--ckpt-format",
                "torch",
            ]
        )
        == 0
    )
    saved = torch.load(tmp_path / "mcore" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["model"]["embedding.word_embeddings.weight"].shape[0] == 128  # padded vocabulary
    assert saved["args"]["rope_scaling_factor"] == 8.0
    assert (
        main(
            [
                "tools",
                "convert-megatron-to-hf",
                "--load",
                str(tmp_path / "mcore"),
                "--save",
                str(tmp_path / "back"),
                "--hf-config",
                hf,
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    _same_hf_weights(hf, str(tmp_path / "back"))


# ---------------------------------------------------------------------------------------------- flags
@pytest.fixture
def qwen2_dir(tmp_path):
    return tiny_hf_model(str(tmp_path / "qwen2"), "qwen2")


def test_megatron_backend_needs_cuda(qwen2_dir):
    pytest.importorskip("megatron.core")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="^--train-backend: 'megatron' needs CUDA"):
        parse_train_args(_args(qwen2_dir, "--train-backend", "megatron"))


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--context-parallel-size", "2"], "--context-parallel-size"),
        (["--rope-scaling-factor", "8"], "--rope-scaling-factor"),
        (["--custom-megatron-init-path", "no_such_module.init"], "--custom-megatron-init-path"),
    ],
)
def test_bad_megatron_flags_name_the_flag(qwen2_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(_args(qwen2_dir, *extra))
    assert str(error.value).startswith(flag), str(error.value)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--num-layers", "3"], "--num-layers"),
        (["--kv-channels", "64"], "--kv-channels"),
        (["--qk-layernorm"], "--qk-layernorm"),  # Qwen3's, not Qwen2's
        (["--untie-embeddings-and-output-weights", "--vocab-size", "17"], "--vocab-size"),
        (["--rotary-base", "1000000"], "--rotary-base"),
        (["--rotary-interleaved"], "--rotary-interleaved"),  # GLM-4's three, not Qwen2's
        (["--post-self-attn-layernorm"], "--post-self-attn-layernorm"),
        (["--post-mlp-layernorm"], "--post-mlp-layernorm"),
        (["--spec", "vime_plugins.models.glm4", "get_glm_spec"], "--spec"),
    ],
)
def test_model_flags_are_checked_against_config_json(qwen2_dir, extra, flag):
    from transformers import AutoConfig

    settings = parse_train_args(_args(qwen2_dir, *extra))
    with pytest.raises(ConfigError) as error:
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(qwen2_dir))
    assert str(error.value).startswith(flag), str(error.value)


def test_preset_flags_resolve_the_architecture(qwen2_dir):
    from transformers import AutoConfig

    from vime.backends.megatron_args import resolve_model_args

    settings = parse_train_args(
        _args(
            qwen2_dir,
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--ffn-hidden-size",
            "96",
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--num-attention-heads",
            "4",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "16",
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            "1e-6",
            "--use-rotary-position-embeddings",
            "--rotary-base",
            "10000",
            "--untie-embeddings-and-output-weights",
            "--vocab-size",
            "16",
            "--ckpt-format",
            "torch",
        )
    )
    args = resolve_model_args(settings.megatron, AutoConfig.from_pretrained(qwen2_dir))
    assert (args.family, args.add_qkv_bias, args.tie_embeddings, args.kv_channels) == ("qwen2", True, False, 16)
    assert settings.megatron.ckpt_format == "torch"


def _preset(name: str) -> list[str]:
    script = f'source "{os.path.join(REPO, "scripts", "models", name)}" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")[:-1]


def test_the_glm4_preset_resolves_glm4_9b_s_config_json(tmp_path):
    """scripts/models/glm4-9B.sh, the reference framework's preset with its --spec, against GLM-4-9B-0414's
    config.json: accepted, and the architecture is GLM-4's (norms after the attention and the MLP, RoPE on half of
    each head in interleaved pairs, QKV bias)."""
    from transformers import AutoConfig

    from vime.backends.megatron_args import resolve_model_args

    config = AutoConfig.for_model("glm4", rms_norm_eps=1e-5, max_position_embeddings=32768)  # GLM-4-9B-0414's
    config.save_pretrained(tmp_path)
    settings = parse_train_args(_args(str(tmp_path), *_preset("glm4-9B.sh")))
    settings.megatron.check_against_hf(config)
    args = resolve_model_args(settings.megatron, config)
    assert (args.family, args.post_sublayer_norms, args.rotary_interleaved) == ("glm4", True, True)
    assert (args.rotary_percent, args.add_qkv_bias, args.kv_channels, args.num_query_groups) == (0.5, True, 128, 2)


def test_a_custom_layer_spec_is_refused_naming_the_flag(qwen2_dir):
    with pytest.raises(ConfigError, match="^--spec: my_plugins.layers get_spec: vime builds its models' layers"):
        parse_train_args(_args(qwen2_dir, "--spec", "my_plugins.layers", "get_spec"))


def test_model_presets_parse(qwen2_dir):
    """Every scripts/models/*.sh is a bash array of flags vime train accepts."""
    folder = os.path.join(REPO, "scripts", "models")
    scripts = sorted(n for n in os.listdir(folder) if n.endswith(".sh"))
    assert {"qwen2-tiny.sh", "qwen3-tiny.sh", "llama-tiny.sh", "qwen3-4B.sh"} <= set(scripts)
    for name in scripts:
        script = f'source "{os.path.join(folder, name)}" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
        assert out, name
        parse_train_args(_args(qwen2_dir, *out))  # parses (cross-checks against a model happen at start)


@pytest.mark.parametrize("preset, arch", [("qwen2-tiny.sh", "qwen2"), ("llama-tiny.sh", "llama")])
def test_tiny_presets_describe_make_tiny_model(tmp_path, preset, arch):
    from transformers import AutoConfig

    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / arch), arch=arch)
    path = os.path.join(REPO, "scripts", "models", preset)
    flags = subprocess.run(
        ["bash", "-c", f'source "{path}" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    parse_train_args(_args(model, *flags)).megatron.check_against_hf(AutoConfig.from_pretrained(model))
