"""GLM-4.5's routing in the Megatron backend: sigmoid scores with an expert bias (--moe-router-enable-expert-bias)
trained like the torch backend trains the HF model, the bias's aux-loss-free step after each optimizer step
(--moe-router-bias-update-rate), and the bias carried to the engines and through checkpoints.

(The logits against HF's model, the naming and the round trip are in test_megatron_moe.py's glm4_moe variant.)"""

import numpy as np
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
from vime.backends import megatron_forward as mf, megatron_model as mm, megatron_weights as mw  # noqa: E402
from vime.backends.megatron_args import model_args_from_hf  # noqa: E402
from vime.backends.megatron_convert import hf_to_mcore, read_hf_state_dict  # noqa: E402
from vime.backends.megatron_expert_bias import biased_routers, update_expert_bias  # noqa: E402

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # the tiny model's one MoE layer


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_moe_hf_model(
        str(tmp_path_factory.mktemp("glm4_moe")), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["glm4_moe"]
    )


def _backend(model_dir, rate: float):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    return MegatronBackend(
        trainer_spec(model_dir), MegatronBackendSpec(model=model, moe=mm.MoeOptions(bias_update_rate=rate))
    )


def test_the_bias_step_follows_the_counted_load(model_dir):
    """update_expert_bias: +rate below the mean load, -rate above it, nothing at it; the counts start again."""
    args = model_args_from_hf(AutoConfig.from_pretrained(model_dir))
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(model_dir), args), args)
    (router,) = biased_routers(gpt)
    lm = mf.MegatronLM(gpt, args.vocab_size, model_args=args)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 0, 0, 0]])
    mask = (ids > 0).long()
    lm(input_ids=ids, attention_mask=mask)  # gradients on: counted
    counts, before = router.local_tokens_per_expert.clone(), router.expert_bias.clone()
    assert counts.sum() == 13 * 2  # 13 real tokens (padding is not counted), top-2
    update_expert_bias(gpt, 0.25)
    expected = before + 0.25 * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, expected) and not torch.equal(expected, before)
    assert router.local_tokens_per_expert.sum() == 0
    with torch.no_grad():  # log-prob passes (no gradient) are not counted
        lm(input_ids=ids, attention_mask=mask)
    assert router.local_tokens_per_expert.sum() == 0
    lm(input_ids=ids, attention_mask=mask)
    update_expert_bias(gpt, 0.0)  # rate 0: the bias stays, the counts are cleared
    assert torch.equal(router.expert_bias, expected) and router.local_tokens_per_expert.sum() == 0


def test_an_rl_step_with_a_frozen_bias_matches_the_torch_backend(model_dir):
    """--moe-router-bias-update-rate 0 (the reference's GLM-4.5 preset): the HF model trained by the torch
    backend, whose bias is a buffer no optimizer steps, gives the same metrics."""
    from vime.backends.torch_backend import TorchBackend

    backend = _backend(model_dir, 0.0)
    ours = backend.train_rollout(make_samples(0), 0)
    theirs = TorchBackend(trainer_spec(model_dir)).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)
    exported = dict(backend.hf_named_weights())
    assert torch.equal(exported[BIAS].float(), read_hf_state_dict(model_dir)[BIAS])


def test_the_bias_moves_each_step_and_reaches_the_engines_and_checkpoints(model_dir, tmp_path):
    from vime.backends import megatron_checkpoint as mc

    backend = _backend(model_dir, 0.01)
    start = read_hf_state_dict(model_dir)[BIAS]
    metrics = backend.train_rollout(make_samples(0), 0)
    assert np.isfinite(metrics["loss"])
    (router,) = biased_routers(backend.gpt)
    steps = (router.expert_bias - start) / 0.01
    # one optimizer step (global batch = the rollout): every expert moved by -1, 0 or +1 rate, some moved
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 1 + 1e-4
    assert steps.abs().max() > 0.5
    assert router.local_tokens_per_expert.sum() == 0
    # the engines receive the moved bias under its HF name
    exported = dict(backend.hf_named_weights())
    assert torch.allclose(exported[BIAS].float(), router.expert_bias)
    # a checkpoint keeps it
    args = backend.megatron.model
    mc.save(str(tmp_path / "iter_0000001"), backend.gpt, None, fmt="torch_dist", iteration=1, args=args.to_dict())
    again = mm.build_gpt_model(args, mm.Parallelism(), initialize=True)
    mc.load(str(tmp_path / "iter_0000001"), again)
    (loaded,) = biased_routers(again)
    assert torch.equal(loaded.expert_bias, router.expert_bias)
