"""Qwen3-Omni in the Megatron backend: its thinker's language model (Qwen3-MoE's layers under thinker.model., its
head thinker.lm_head) is built and trained, its vision tower and audio encoder carried unchanged into every
export; the reference's preset flags (--spec ... get_qwen3_omni_model_provider, --use-qwen-vl) are checked
against config.json."""

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
from vime.backends.megatron_convert import hf_to_mcore, mcore_to_hf, read_hf_state_dict  # noqa: E402
from vime.config import parse_train_args  # noqa: E402

TOWERS = ("thinker.visual.", "thinker.audio_tower.")
# The reference's preset (scripts/models/qwen3_omni_moe.sh: qwen3-30B-A3B.sh's flags and these two), with the tiny
# model's numbers.
OMNI_FLAGS = [
    *("--spec", "vime_plugins.models.qwen3_omni_moe", "get_qwen3_omni_model_provider"),
    "--use-qwen-vl",
    *("--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48"),
    *("--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16"),
    *("--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--qk-layernorm", "--swiglu"),
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    *("--moe-ffn-hidden-size", "24", "--moe-router-topk", "2", "--num-experts", "4"),
]


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen3_omni_model(str(tmp_path_factory.mktemp("qwen3_omni")), with_tokenizer=True)


def test_the_thinker_s_language_model_gives_hf_s_logits(omni_dir):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    from vime.backends import megatron_forward as mf, megatron_weights as mw

    args = model_args_from_hf(AutoConfig.from_pretrained(omni_dir))
    assert (args.family, args.hf_prefix, args.hf_head) == (
        "qwen3_omni_moe_text",
        "thinker.model.",
        "thinker.lm_head.weight",
    )
    assert (args.num_experts, args.moe_router_topk, args.qk_layernorm, args.tie_embeddings) == (4, 2, True, False)
    hf_state = read_hf_state_dict(omni_dir)
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(hf_state, args), args)
    ids = torch.tensor([[1, 5, 7, 3, 2, 9, 4, 6]])
    mask = torch.ones_like(ids)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = mf.MegatronLM(gpt.eval(), args.vocab_size, model_args=args)(input_ids=ids, attention_mask=mask).logits
        # (the thinker's own forward first computes multimodal RoPE positions; text alone, its language model's)
        theirs = hf.thinker.lm_head(hf.thinker.model(input_ids=ids, attention_mask=mask).last_hidden_state)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # The language model's tensors come back under their HF names; the towers are not the Megatron model's.
    back = mcore_to_hf(mw.gather_canonical(gpt, args), args)
    language = {n for n in hf_state if not n.startswith(TOWERS)}
    assert back.keys() == language and all(torch.equal(back[n], hf_state[n]) for n in language)


def test_an_rl_step_trains_the_language_model_and_exports_the_checkpoint_whole(omni_dir, tmp_path):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.backends.torch_backend import TorchBackend

    model = model_args_from_hf(AutoConfig.from_pretrained(omni_dir))
    backend = MegatronBackend(trainer_spec(omni_dir), MegatronBackendSpec(model=model))
    ours = backend.train_rollout(make_samples(0), 0)
    # The same step as the torch backend's on HF's Qwen3-MoE holding the thinker's language model
    theirs = TorchBackend(trainer_spec(_as_qwen3_moe(omni_dir, str(tmp_path / "qwen3_moe")))).train_rollout(
        make_samples(0), 0
    )
    assert_same_metrics(ours, theirs)
    backend.save_hf(str(tmp_path / "out"))
    source, exported = read_hf_state_dict(omni_dir), read_hf_state_dict(str(tmp_path / "out"))
    assert exported.keys() == source.keys()
    towers = [n for n in source if n.startswith(TOWERS)]
    assert towers and all(torch.equal(exported[n], source[n]) for n in towers)
    trained = dict(backend.hf_named_weights())  # what the engines load at each step: the language model
    assert set(trained) == set(source) - set(towers)
    assert not torch.equal(exported["thinker.lm_head.weight"], source["thinker.lm_head.weight"])
    # HF's Qwen3-Omni loads the export whole
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    _, loading = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]


def _as_qwen3_moe(omni_dir: str, out_dir: str) -> str:
    """The thinker's language model as an HF Qwen3-MoE checkpoint (its text config, its tensors renamed), with
    the tokenizer: the architecture Qwen3-Omni's thinker shares for text."""
    import shutil

    from safetensors.torch import save_file

    text = AutoConfig.from_pretrained(omni_dir).thinker_config.text_config.to_dict()
    config = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in text.items() if k != "model_type"})
    config.tie_word_embeddings = False
    config.save_pretrained(out_dir)
    renamed = {
        name.removeprefix("thinker."): tensor.contiguous()
        for name, tensor in read_hf_state_dict(omni_dir).items()
        if not name.startswith(TOWERS)
    }
    save_file(renamed, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(source := f"{omni_dir}/{name}"):
            shutil.copy(source, out_dir)
    return out_dir


def test_the_reference_preset_s_flags_agree_with_config_json(omni_dir):
    settings = parse_train_args(_args(omni_dir, *OMNI_FLAGS))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(omni_dir), "megatron")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--use-qwen-vl"], "--use-qwen-vl"),
        (["--spec", "vime_plugins.models.qwen3_omni_moe", "get_qwen3_omni_model_provider"], "--spec"),
    ],
)
def test_its_flags_on_a_text_only_model_are_refused(tmp_path, extra, flag):
    folder = megatron_shim.tiny_moe_hf_model(str(tmp_path / "qwen"), **megatron_shim.MOE_VARIANTS["qwen3_moe"])
    said = refused_against_config_json(folder, *extra)
    assert said.startswith(flag), said


def test_the_conversion_commands_round_trip_the_checkpoint(omni_dir, tmp_path):
    """vime tools convert-hf-to-megatron / convert-megatron-to-hf: the thinker's language model goes through
    Megatron, the towers come back from --hf-config's weights; exact."""
    megatron_shim.assert_conversion_commands_round_trip(omni_dir, str(tmp_path))


def test_the_torch_backend_is_refused_at_start_up_naming_the_flag(omni_dir):
    from vime.config import ConfigError
    from vime.preflight import check_torch_backend_trains_it

    with pytest.raises(ConfigError, match="^--train-backend: torch cannot train --hf-checkpoint's qwen3_omni_moe"):
        check_torch_backend_trains_it(omni_dir)
