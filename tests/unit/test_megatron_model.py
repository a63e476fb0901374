"""A megatron-core GPTModel built from an HF config gives HF's logits on the same weights (float32, CPU)."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests import megatron_shim  # noqa: E402
from vime.backends import megatron_forward as mf, megatron_model as mm, megatron_weights as mw  # noqa: E402
from vime.backends.megatron_args import model_args_from_hf  # noqa: E402
from vime.backends.megatron_convert import hf_to_mcore, mcore_to_hf, read_hf_state_dict  # noqa: E402

VARIANTS = {
    "qwen2": dict(family="qwen2"),
    "llama3_rope_scaling": dict(family="llama", rope_scaling=True),
    "qwen3_tied_head_dim": dict(family="qwen3", tie=True),
    # post-sublayer norms, interleaved and partial RoPE, QKV biases, a fused gate/up projection
    "glm4": dict(family="glm4"),
    # a dense hybrid: a gated delta net, then gated attention; zero-centred norms, RoPE on a quarter of each head
    "qwen3_5_text": dict(family="qwen3_5_text"),
}


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    folder = megatron_shim.tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])
    return folder, model_args_from_hf(AutoConfig.from_pretrained(folder))


def _batch():
    ids = torch.tensor(
        [[1, 2, 3, 4, 5, 11, 6, 7, 8, 9], [3, 4, 5, 11, 6, 15, 0, 0, 0, 0], [7, 7, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    lengths = torch.tensor([[10], [6], [2]])
    return ids, (torch.arange(10) < lengths).long()


def test_logits_match_hf(tiny):
    folder, args = tiny
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(folder), args), args)
    # The vocabulary (16) is padded to 128 rows inside Megatron; only the real ones come out.
    assert gpt.embedding.word_embeddings.weight.shape[0] == 128
    ids, mask = _batch()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = mf.MegatronLM(gpt.eval(), args.vocab_size)(input_ids=ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    assert ours.shape == theirs.shape
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)


def test_data_pad_size_multiplier_pads_the_sequence_and_changes_no_logit(tiny, monkeypatch):
    """--data-pad-size-multiplier 8 pads the 10 positions to 16 (x TP 1), and the real logits are the same."""
    folder, args = tiny
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(folder), args), args)
    ids, mask = _batch()
    seen = []
    forward = gpt.forward
    monkeypatch.setattr(
        gpt, "forward", lambda input_ids, *a, **k: seen.append(input_ids.shape[1]) or forward(input_ids, *a, **k)
    )
    with torch.no_grad():
        plain = mf.MegatronLM(gpt.eval(), args.vocab_size)(input_ids=ids, attention_mask=mask).logits
        padded = mf.MegatronLM(gpt.eval(), args.vocab_size, pad_size_multiplier=8)(
            input_ids=ids, attention_mask=mask
        ).logits
    assert seen == [10, 16] and padded.shape == plain.shape
    real = mask.bool()
    torch.testing.assert_close(padded[real], plain[real], rtol=1e-5, atol=1e-5)


def test_weights_round_trip_through_the_model(tiny):
    folder, args = tiny
    hf = read_hf_state_dict(folder)
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(hf, args), args)
    back = mcore_to_hf(mw.gather_canonical(gpt, args), args)
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_a_state_dict_that_does_not_fit_is_refused(tiny):
    folder, args = tiny
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    canonical = hf_to_mcore(read_hf_state_dict(folder), args)
    canonical.pop("decoder.final_layernorm.weight")
    with pytest.raises(ValueError, match="final_layernorm"):
        mw.load_canonical(gpt, canonical, args)
