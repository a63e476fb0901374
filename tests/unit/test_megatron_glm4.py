"""GLM-4 (dense) on the Megatron backend: its norms after the attention and the MLP and its RoPE on half of each
head in interleaved pairs train as HF's Glm4ForCausalLM does on the torch backend, at TP=1 and at TP=2 with
sequence parallelism (two gloo ranks), and the weights exported are HF's, those norms included."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from transformers import AutoModelForCausalLM  # noqa: E402

from tests import megatron_shim  # noqa: E402
from tests.gloo_ranks import join_group, leave_group, run_ranks  # noqa: E402
from tests.numerics import ADAMW_WEIGHT_ATOL  # noqa: E402
from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, megatron_spec, trainer_spec  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.torch_backend import TorchBackend  # noqa: E402
from vime.runtime.ports import free_port  # noqa: E402

HEAD, ROTATED = 16, 8  # tiny_hf_model's GLM-4: heads of 16 dimensions, partial_rotary_factor 0.5
LR, ROLLOUTS = 1e-3, 2  # trainer_spec's learning rate; one optimizer step per rollout


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    return megatron_shim.tiny_hf_model(str(tmp_path_factory.mktemp("glm4")), "glm4", with_tokenizer=True)


def assert_same_glm4_weights(exported: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """The key bias's dimensions RoPE leaves alone add the same amount to every score of a query: their gradient
    is zero but for rounding, which AdamW scales up to a step of up to lr either way. Those are compared within
    one step per rollout on each side; every other weight as tightly as for the other families."""
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        ours = exported[name]
        if name.endswith("k_proj.bias"):
            shift_invariant = (torch.arange(tensor.numel()) % HEAD) >= ROTATED
            assert (ours - tensor).abs()[shift_invariant].max() <= 2 * ROLLOUTS * LR, name
            ours, tensor = ours[~shift_invariant], tensor[~shift_invariant]
        torch.testing.assert_close(ours, tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)


def test_glm4_trains_as_on_the_torch_backend(glm4_dir):
    torch_backend = TorchBackend(trainer_spec(glm4_dir))
    megatron = MegatronBackend(trainer_spec(glm4_dir), megatron_spec(glm4_dir))
    for rollout in range(ROLLOUTS):
        samples = make_samples(rollout)
        assert_same_metrics(megatron.train_rollout(samples, 0), torch_backend.train_rollout(samples, 0))
    exported = dict(megatron.hf_named_weights())
    assert_same_glm4_weights(exported, {n: t.detach() for n, t in torch_backend.model.named_parameters()})
    initial = AutoModelForCausalLM.from_pretrained(glm4_dir).state_dict()
    for name in ("model.layers.1.post_self_attn_layernorm.weight", "model.layers.1.post_mlp_layernorm.weight"):
        assert not torch.equal(exported[name], initial[name]), name  # trained


def _tp2_worker(rank: int, port: int, model_dir: str, work: str) -> None:
    join_group(rank, port, megatron_shim=True)
    from vime.backends.megatron_model import Parallelism

    parallel = Parallelism(tensor=2, sequence_parallel=True)
    backend = MegatronBackend(trainer_spec(model_dir), megatron_spec(model_dir, parallel=parallel))
    metrics = [backend.train_rollout(make_samples(r), 0) for r in range(ROLLOUTS)]
    weights = {n: t.clone() for n, t in backend.hf_named_weights()}
    torch.save({"metrics": metrics, "weights": weights}, os.path.join(work, f"tp2_{rank}.pt"))
    leave_group()


def test_glm4_under_tensor_and_sequence_parallelism_trains_as_one_rank_does(glm4_dir, tmp_path):
    """Sequence parallelism hands each rank's post-sublayer norms half the tokens: their gradients must be summed
    over the ranks (a norm that missed the sum would step differently from the one-rank run)."""
    one = MegatronBackend(trainer_spec(glm4_dir), megatron_spec(glm4_dir))
    reference = [one.train_rollout(make_samples(r), 0) for r in range(ROLLOUTS)]
    run_ranks(_tp2_worker, (free_port(), glm4_dir, str(tmp_path)), 2)
    tp2, other = (torch.load(tmp_path / f"tp2_{rank}.pt", weights_only=False) for rank in range(2))
    for ours, theirs in zip(tp2["metrics"], reference):
        assert_same_metrics(ours, theirs)
    assert_same_glm4_weights(tp2["weights"], dict(one.hf_named_weights()))
    assert all(torch.equal(tp2["weights"][n], other["weights"][n]) for n in tp2["weights"])
