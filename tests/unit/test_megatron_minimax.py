"""MiniMax-M2 in the Megatron backend: an RL step equal to the torch backend's (the HF model), its query and key norms
over all heads, the reference preset's flags checked against config.json, tensor parallelism refused.

(The logits against HF's model and the naming are test_megatron_moe.py's minimax_m2 variant.)"""

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
from vime.backends.megatron_layers import KeyNormOverHeads, QueryNormOverHeads  # noqa: E402
from vime.config import parse_train_args  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_moe_hf_model(
        str(tmp_path_factory.mktemp("minimax_m2")), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["minimax_m2"]
    )


def test_an_rl_step_matches_the_torch_backend(model_dir):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.backends.torch_backend import TorchBackend

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    backend = MegatronBackend(trainer_spec(model_dir), MegatronBackendSpec(model=model))
    attention = backend.gpt.decoder.layers[0].self_attention
    assert isinstance(attention.q_layernorm, QueryNormOverHeads) and isinstance(attention.k_layernorm, KeyNormOverHeads)
    ours = backend.train_rollout(make_samples(0), 0)
    theirs = TorchBackend(trainer_spec(model_dir)).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)
    assert {n for n, _ in backend.hf_named_weights()} == set(read_hf_state_dict(model_dir))


def test_the_norm_over_heads_is_one_rms_over_the_whole_projection():
    args = megatron_shim.tiny_model_args("minimax_m2", num_attention_heads=2, num_query_groups=1, kv_channels=2)
    config = mm.transformer_config(args, mm.Parallelism())
    norm = QueryNormOverHeads(config, hidden_size=2, eps=0.0)  # 2 heads of 2 dimensions
    x = torch.tensor([[[3.0, 3.0], [1.0, 1.0]]])  # the heads' scales differ: a norm per head would even them
    torch.testing.assert_close(norm(x), x / (5.0**0.5))  # rms over all four values is sqrt(5)


# The reference's MiniMax-M2.5 preset (scripts/models/minimax-m2.sh), the tiny model's numbers.
MINIMAX_FLAGS = [
    *("--spec", "vime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"),
    "--disable-bias-linear",
    *("--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "24"),
    *("--num-attention-heads", "4", "--kv-channels", "16", "--num-query-groups", "2"),
    *("--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6"),
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    *("--rotary-percent", "0.5", "--qk-layernorm"),
    *("--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2", "--moe-layer-freq", "[1]*2"),
    "--moe-router-pre-softmax",  # (moot for sigmoid scores, as in Megatron-LM)
    *("--moe-router-score-function", "sigmoid"),
    "--moe-router-enable-expert-bias",
    *("--moe-router-load-balancing-type", "none", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"),
]


def test_the_presets_flags_agree_with_config_json(model_dir):
    settings = parse_train_args(_args(model_dir, *MINIMAX_FLAGS))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(model_dir), "megatron")
    for extra, flag in [(["--rotary-percent", "1.0"], "--rotary-percent"), (["--num-experts", "8"], "--num-experts")]:
        said = refused_against_config_json(model_dir, *extra)
        assert said.startswith(flag), said


def test_tensor_parallelism_is_refused_naming_the_flag(model_dir):
    from vime.backends.megatron_setup import check_query_key_norms_over_heads
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    check_query_key_norms_over_heads(MegatronBackendSpec(model=model))
    spread = MegatronBackendSpec(model=model, parallel=mm.Parallelism(tensor=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="^--tensor-model-parallel-size 2: minimax_m2's query and key norms"):
        check_query_key_norms_over_heads(spread)
