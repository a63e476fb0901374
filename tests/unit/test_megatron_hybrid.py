"""Hybrid models in the Megatron backend, Qwen3-Next and Qwen3.5 (gated delta nets between gated softmax attention,
zero-centred norms): an RL step equal to the torch backend's (the HF model), the HF round trip, the reference
presets' flags checked against config.json, the parallel layouts not built yet refused, a torch_dist checkpoint's
round trip.

(The logits against HF's model are test_megatron_moe.py's qwen3_next and qwen3_5_moe_text variants and
test_megatron_model.py's qwen3_5_text.)"""

import os

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
from vime.backends.megatron_convert import (  # noqa: E402
    fuse_gated_delta_net_projection,
    fuse_gated_qkv,
    hf_to_mcore,
    mcore_to_hf,
    read_hf_state_dict,
)
from vime.backends.megatron_layers import ZeroCenteredRMSNorm  # noqa: E402
from vime.config import parse_train_args  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def model_dir(request, tmp_path_factory):
    """Qwen3-Next (MoE, fused delta-net projections) and a dense Qwen3.5 language model (four projections)."""
    folder = str(tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_5_text":
        return megatron_shim.tiny_hf_model(folder, "qwen3_5_text", with_tokenizer=True)
    return megatron_shim.tiny_moe_hf_model(folder, with_tokenizer=True, **megatron_shim.MOE_VARIANTS["qwen3_next"])


def _model_args(folder: str):
    return model_args_from_hf(AutoConfig.from_pretrained(folder))


def test_an_rl_step_matches_the_torch_backend(model_dir):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.backends.torch_backend import TorchBackend

    backend = MegatronBackend(trainer_spec(model_dir), MegatronBackendSpec(model=_model_args(model_dir)))
    assert backend.packing == "padded"
    before = {n: p.detach().clone() for n, p in backend.gpt.named_parameters()}
    ours = backend.train_rollout(make_samples(0), 0)
    theirs = TorchBackend(trainer_spec(model_dir)).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)
    changed = {n for n, p in backend.gpt.named_parameters() if not torch.equal(p, before[n])}
    delta_net = "decoder.layers.0.self_attention."
    assert {delta_net + name for name in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log")} <= changed
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in changed  # queries, gates, keys, values
    # the engines get every HF tensor, the delta net's included
    assert {n for n, _ in backend.hf_named_weights()} == set(read_hf_state_dict(model_dir))


@pytest.fixture(scope="module")
def vision_language_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen3_5_vl_model(str(tmp_path_factory.mktemp("qwen3_5_vl")), with_tokenizer=True)


def test_a_vision_language_checkpoint_trains_its_language_model_and_exports_it_whole(vision_language_dir, tmp_path):
    """Qwen3.5's checkpoints hold a vision tower beside the language model (model.language_model.*): the Megatron
    backend trains the language model as the torch backend does (HF's Qwen3_5ForCausalLM over the same tensors),
    and what it exports is the whole checkpoint again, the vision tower unchanged."""
    from transformers import AutoModelForImageTextToText

    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.backends.torch_backend import TorchBackend

    model = _model_args(vision_language_dir)
    assert (model.family, model.hf_prefix) == ("qwen3_5_text", "model.language_model.")
    backend = MegatronBackend(trainer_spec(vision_language_dir), MegatronBackendSpec(model=model))
    ours = backend.train_rollout(make_samples(0), 0)
    theirs = TorchBackend(trainer_spec(vision_language_dir)).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)
    backend.save_hf(str(tmp_path / "out"))
    source, exported = read_hf_state_dict(vision_language_dir), read_hf_state_dict(str(tmp_path / "out"))
    assert exported.keys() == source.keys()
    vision = [n for n in source if n.startswith("model.visual.")]
    assert vision and all(torch.equal(exported[n], source[n]) for n in vision)
    trained = dict(backend.hf_named_weights())
    assert set(trained) == set(source) - set(vision)
    assert all(torch.equal(exported[n], trained[n]) for n in trained)
    assert not torch.equal(exported["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"], source[
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])  # fmt: skip
    _, loading = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]  # HF's vision-language model loads it whole


def test_the_multi_token_prediction_weights_are_exported_unchanged(model_dir, tmp_path):
    """A released checkpoint's MTP layers (mtp.*; HF's model ignores them) are not trained; the final export
    carries them, so that it stays a whole checkpoint, and the weights published at each step leave them out."""
    import shutil

    from safetensors.torch import save_file

    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec

    folder = str(tmp_path / "with_mtp")
    shutil.copytree(model_dir, folder)
    mtp = {"mtp.fc.weight": torch.randn(4, 8), "mtp.layers.0.input_layernorm.weight": torch.randn(8)}
    save_file(mtp, os.path.join(folder, "model-mtp.safetensors"))
    backend = MegatronBackend(trainer_spec(folder), MegatronBackendSpec(model=_model_args(folder)))
    backend.save_hf(str(tmp_path / "out"))
    exported = read_hf_state_dict(str(tmp_path / "out"))
    assert all(torch.equal(exported[name], tensor) for name, tensor in mtp.items())
    assert exported.keys() == read_hf_state_dict(folder).keys()
    # the weights the engines load at each step leave them as loaded
    backend.save_weights(str(tmp_path / "published"))
    assert not set(read_hf_state_dict(str(tmp_path / "published"))) & set(mtp)
    assert not {n for n, _ in backend.hf_named_weights()} & set(mtp)


def test_the_conversion_commands_round_trip_a_vision_language_checkpoint(vision_language_dir, tmp_path):
    """vime tools convert-hf-to-megatron / convert-megatron-to-hf on Qwen3.5's vision-language checkpoint: the
    language model goes through Megatron, the vision tower comes back from --hf-config's weights; exact."""
    megatron_shim.assert_conversion_commands_round_trip(vision_language_dir, str(tmp_path))


def test_the_qwen3_5_preset_agrees_with_a_vision_language_config_json(vision_language_dir):
    settings = parse_train_args(_args(vision_language_dir, *QWEN3_5_FLAGS))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(vision_language_dir), "megatron")
    said = refused_against_config_json(vision_language_dir, "--rotary-percent", "0.5")
    assert said.startswith("--rotary-percent"), said


def test_the_zero_centred_norm_scales_by_one_plus_its_weight():
    config = mm.transformer_config(_tiny_args(), mm.Parallelism())
    norm = ZeroCenteredRMSNorm(config, hidden_size=4, eps=0.0)
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # root mean square 1
    torch.testing.assert_close(norm(x), x)  # a fresh weight is zero: the plain normalisation
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 0.0, -1.0, 0.5]))
    torch.testing.assert_close(norm(x * 3), torch.tensor([[2.0, -1.0, 0.0, -1.5]]))


def test_hf_megatron_hf_round_trip_is_exact(model_dir):
    args = _model_args(model_dir)
    hf = read_hf_state_dict(model_dir)
    mcore = hf_to_mcore(hf, args)
    key_heads, value_heads = args.linear_num_key_heads, args.linear_num_value_heads
    rows = 2 * key_heads * args.linear_key_head_dim + 2 * value_heads * args.linear_value_head_dim + 2 * value_heads
    assert mcore["decoder.layers.0.self_attention.in_proj.weight"].shape == (rows, args.hidden_size)
    back = mcore_to_hf(mcore, args)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def _tiny_args():
    return megatron_shim.tiny_model_args(
        "qwen3_next",
        attention_output_gate=True,
        zero_centered_norms=True,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=2,
        linear_value_head_dim=3,
        linear_conv_kernel_dim=2,
    )


def test_the_projections_regroup_by_kind():
    """HF groups by head (query then gate; a key head's query, key, values, gates), megatron-core by kind: each row
    of the fused tensors is labelled with where it came from and read back in megatron-core's order."""
    args = _tiny_args()
    # q_proj: 4 heads of (3 query rows, 3 gate rows); k/v: 2 groups of 3 rows. Row value = its label.
    q = torch.tensor(
        [100 * h + 10 * part + i for h in range(4) for part in (0, 1) for i in range(3)], dtype=torch.float
    )
    k, v = torch.arange(6.0) + 1000, torch.arange(6.0) + 2000
    fused = fuse_gated_qkv(q, k, v, args).tolist()
    group0 = [0, 1, 2, 100, 101, 102, 10, 11, 12, 110, 111, 112, 1000, 1001, 1002, 2000, 2001, 2002]
    assert fused[:18] == group0  # its two heads' queries, their gates, its key, its value
    # in_proj_qkvz: per key head j: q_j (2), k_j (2), v_j (2 value heads x 3), z_j (2 x 3); in_proj_ba: b_j (2), a_j (2)
    qkvz = torch.tensor(
        [100 * j + 10 * part + i for j in range(2) for part, n in enumerate((2, 2, 6, 6)) for i in range(n)]
    )
    ba = torch.tensor([1000 + 100 * j + 10 * part + i for j in range(2) for part in range(2) for i in range(2)])
    fused = fuse_gated_delta_net_projection(qkvz[:, None].float(), ba[:, None].float(), args)[:, 0].tolist()
    queries, keys = [0, 1, 100, 101], [10, 11, 110, 111]
    assert fused[:8] == queries + keys
    assert fused[8:20] == [20 + i for i in range(6)] + [120 + i for i in range(6)]  # values
    assert fused[-8:] == [1000, 1001, 1100, 1101, 1010, 1011, 1110, 1111]  # betas, then alphas


# The reference's Qwen3-Next preset (scripts/models/qwen3-next-80B-A3B.sh), the tiny model's numbers.
QWEN3_NEXT_FLAGS = [
    *("--spec", "vime_plugins.models.qwen3_next", "get_qwen3_next_spec"),
    "--disable-bias-linear",
    "--qk-layernorm",
    "--group-query-attention",
    *("--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16"),
    *("--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48"),
    "--use-gated-attention",
    *("--normalization", "RMSNorm"),
    "--apply-layernorm-1p",
    *("--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--rotary-percent", "0.25"),
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    *("--rotary-base", "10000"),
    *("--moe-ffn-hidden-size", "24", "--moe-shared-expert-intermediate-size", "24"),
    *("--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall"),
    *("--moe-router-topk", "2", "--moe-layer-freq", "[1, 1]", "--num-experts", "4"),
    *("--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"),
    "--attention-output-gate",
    "--moe-shared-expert-gate",
]


# The reference's Qwen3.5 preset (scripts/models/qwen3.5-4B.sh), the tiny model's numbers.
QWEN3_5_FLAGS = [
    *("--spec", "vime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    "--disable-bias-linear",
    "--qk-layernorm",
    "--group-query-attention",
    *("--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16"),
    *("--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96"),
    "--use-gated-attention",
    *("--normalization", "RMSNorm"),
    "--apply-layernorm-1p",
    *("--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--rotary-percent", "0.25"),
    "--swiglu",
    *("--rotary-base", "10000"),
    "--attention-output-gate",
]


def test_the_presets_flags_agree_with_config_json(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    flags = QWEN3_NEXT_FLAGS if config.model_type == "qwen3_next" else QWEN3_5_FLAGS
    settings = parse_train_args(_args(model_dir, *flags))
    settings.megatron.check_against_hf(config, "megatron")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
        (["--attention-output-gate"], "--attention-output-gate"),
        (["--use-gated-attention"], "--use-gated-attention"),
        (["--spec", "vime_plugins.models.qwen3_next", "get_qwen3_next_spec"], "--spec"),
        (["--spec", "vime_plugins.models.qwen3_5", "get_qwen3_5_spec"], "--spec"),
    ],
)
def test_its_flags_on_another_model_are_refused(tmp_path, extra, flag):
    folder = megatron_shim.tiny_moe_hf_model(str(tmp_path / "qwen"), **megatron_shim.MOE_VARIANTS["qwen3_moe"])
    said = refused_against_config_json(folder, *extra)
    assert said.startswith(flag), said


def test_flags_that_disagree_are_refused(model_dir):
    for extra, flag in [(["--rotary-percent", "0.5"], "--rotary-percent"), (["--kv-channels", "8"], "--kv-channels")]:
        said = refused_against_config_json(model_dir, *extra)
        assert said.startswith(flag), said


@pytest.mark.parametrize(
    "parallel, packing, flag",
    [
        (mm.Parallelism(tensor=2, sequence_parallel=True), "auto", "--tensor-model-parallel-size 2"),
        (mm.Parallelism(context=2), "padded", "--context-parallel-size 2"),
        (mm.Parallelism(), "thd", "--megatron-packing thd"),
    ],
)
def test_layouts_not_built_yet_are_refused_naming_the_flag(model_dir, parallel, packing, flag):
    from vime.backends.megatron_setup import check_linear_attention
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = _model_args(model_dir)
    check_linear_attention(MegatronBackendSpec(model=model))
    with pytest.raises(ValueError, match=f"^{flag}: {model.family}'s gated delta-net layers"):
        check_linear_attention(MegatronBackendSpec(model=model, parallel=parallel, packing=packing))


def test_a_torch_dist_checkpoint_round_trips(model_dir, tmp_path):
    from vime.backends import megatron_checkpoint as mc, megatron_weights as mw
    from vime.backends.megatron_convert import hf_to_mcore

    args = _model_args(model_dir)
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(model_dir), args), args)
    mc.save(str(tmp_path / "iter_0000001"), gpt, None, fmt="torch_dist", iteration=1, args=args.to_dict())
    again = mm.build_gpt_model(args, mm.Parallelism(), initialize=True)
    mc.load(str(tmp_path / "iter_0000001"), again)
    expected, got = mw.gather_canonical(gpt, args), mw.gather_canonical(again, args)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
