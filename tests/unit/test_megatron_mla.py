"""Multi-latent attention (DeepSeek-V3) in the Megatron backend: an RL step equal to the torch backend's (the HF
model), the MLA flags checked against config.json, and the parallel layouts not built yet refused.

(The logits against HF's model, with YaRN and without a query latent, and the naming are test_megatron_moe.py's
deepseek_v3 and moonlight variants.)"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from test_megatron_backend import assert_same_metrics, trainer_spec  # noqa: E402
from test_megatron_moe_r3 import make_samples  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from tests import megatron_shim  # noqa: E402
from tests.train_args import minimal_train_argv as _args, refused_against_config_json  # noqa: E402
from vime.backends import megatron_model as mm  # noqa: E402
from vime.backends.megatron_args import model_args_from_hf  # noqa: E402
from vime.backends.megatron_convert import read_hf_state_dict  # noqa: E402
from vime.backends.megatron_mla import LatentCoreAttention  # noqa: E402
from vime.config import ConfigError, parse_train_args  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_moe_hf_model(
        str(tmp_path_factory.mktemp("deepseek_v3")), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["deepseek_v3"]
    )


def test_an_rl_step_matches_the_torch_backend(model_dir):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.backends.torch_backend import TorchBackend

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    backend = MegatronBackend(
        trainer_spec(model_dir), MegatronBackendSpec(model=model, moe=mm.MoeOptions(bias_update_rate=0.0))
    )
    before = {n: p.detach().clone() for n, p in backend.gpt.named_parameters()}
    ours = backend.train_rollout(make_samples(0), 0)
    theirs = TorchBackend(trainer_spec(model_dir)).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)
    changed = {n for n, p in backend.gpt.named_parameters() if not torch.equal(p, before[n])}
    assert {"decoder.layers.0.self_attention.linear_kv_down_proj.weight"} <= changed  # the latents train
    # the engines get every HF tensor, the attention's latents included
    assert {n for n, _ in backend.hf_named_weights()} == set(read_hf_state_dict(model_dir))


def test_the_core_attention_is_causal_without_a_mask_and_follows_one():
    attention = LatentCoreAttention(None, 1, softmax_scale=0.5, k_channels=6, v_channels=3)
    q, k = torch.randn(5, 2, 4, 6), torch.randn(5, 2, 4, 6)
    v = torch.randn(5, 2, 4, 3)
    causal = attention(q, k, v, None)
    assert causal.shape == (5, 2, 12)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)[None, None].expand(2, 1, 5, 5)
    torch.testing.assert_close(attention(q, k, v, mask), causal)
    # the first query sees only the first key: its output is the first value
    torch.testing.assert_close(causal[0].view(2, 4, 3), v[0])
    with pytest.raises(ValueError, match="packed .* needs Transformer Engine"):
        attention(q, k, v, None, packed_seq_params=object())


# The reference's DeepSeek-V3 preset's attention flags (scripts/models/deepseek-v3.sh), the tiny model's numbers.
MLA_FLAGS = [
    "--multi-latent-attention",
    "--q-lora-rank",
    "12",
    "--kv-lora-rank",
    "8",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "4",
    "--v-head-dim",
    "6",
    "--kv-channels",
    "8",
    "--qk-layernorm",
    "--rotary-scaling-factor",
    "4",
    "--mscale",
    "1.0",
    "--mscale-all-dim",
    "0.8",
    "--no-position-embedding",
]


def test_the_presets_mla_flags_agree_with_config_json(model_dir):
    settings = parse_train_args(_args(model_dir, *MLA_FLAGS))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(model_dir), "megatron")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--multi-latent-attention", "--kv-lora-rank", "16"], "--kv-lora-rank"),
        (["--multi-latent-attention", "--q-lora-rank", "8"], "--q-lora-rank"),
        (["--multi-latent-attention", "--v-head-dim", "8"], "--v-head-dim"),
        (["--mscale-all-dim", "1.0"], "--mscale-all-dim"),
        (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor"),
    ],
)
def test_mla_flags_that_disagree_are_refused(model_dir, extra, flag):
    said = refused_against_config_json(model_dir, *extra)
    assert said.startswith(flag), said


def test_rope_type_must_be_config_jsons(model_dir, tmp_path):
    """--rope-type (Megatron-LM's; the reference's GLM-4.7 NPU script passes 'rope' to undo MLA's default yarn):
    vime reads the variant from config.json, and the flag is checked against it."""
    plain = megatron_shim.tiny_moe_hf_model(str(tmp_path / "qwen"), **megatron_shim.MOE_VARIANTS["qwen3_moe"])
    for folder, agrees, disagrees, said in [(model_dir, "yarn", "rope", "yarn"), (plain, "rope", "yarn", "none")]:
        settings = parse_train_args(_args(folder, "--rope-type", agrees))
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(folder), "megatron")
        message = refused_against_config_json(folder, "--rope-type", disagrees)
        assert message.startswith(f"--rope-type: '{disagrees}' disagrees") and f"RoPE scaling: {said}" in message
    with pytest.raises(SystemExit):
        parse_train_args(_args(model_dir, "--rope-type", "llama3"))


def test_mla_flags_on_a_model_without_it_are_refused(tmp_path):
    folder = megatron_shim.tiny_moe_hf_model(str(tmp_path / "qwen"), **megatron_shim.MOE_VARIANTS["qwen3_moe"])
    for extra, flag in [
        (["--multi-latent-attention"], "--multi-latent-attention"),
        (["--multi-latent-attention", "--kv-lora-rank", "8"], "--kv-lora-rank"),
    ]:
        said = refused_against_config_json(folder, *extra)
        assert said.startswith(flag), said
    with pytest.raises(ConfigError, match="^--kv-lora-rank: needs --multi-latent-attention"):
        parse_train_args(_args(folder, "--kv-lora-rank", "8"))


def test_mla_under_tensor_parallelism_is_refused_naming_the_flag(model_dir):
    from vime.backends.megatron_setup import check_mla_parallelism
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    check_mla_parallelism(MegatronBackendSpec(model=model))
    spread = MegatronBackendSpec(model=model, parallel=mm.Parallelism(tensor=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="^--tensor-model-parallel-size 2: multi-latent attention"):
        check_mla_parallelism(spread)


def test_a_torch_dist_checkpoint_round_trips(model_dir, tmp_path):
    from vime.backends import megatron_checkpoint as mc, megatron_weights as mw
    from vime.backends.megatron_convert import hf_to_mcore

    args = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(model_dir), args), args)
    mc.save(str(tmp_path / "iter_0000001"), gpt, None, fmt="torch_dist", iteration=1, args=args.to_dict())
    again = mm.build_gpt_model(args, mm.Parallelism(), initialize=True)
    mc.load(str(tmp_path / "iter_0000001"), again)
    expected, got = mw.gather_canonical(gpt, args), mw.gather_canonical(again, args)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
