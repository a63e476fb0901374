"""Tensor parallelism 2 over gloo (two spawned CPU processes): one RL step gives the torch backend's numbers,
and torch_dist checkpoints move between TP=1 and TP=2 with the optimizer state.

The pytest process trains rollout A at TP=1 and saves a torch_dist checkpoint; two processes load it at
TP=2, train rollout B and save torch_dist and torch checkpoints; the pytest process loads the TP=2
torch_dist checkpoint at TP=1 and trains rollout C. The torch backend training A, B, C in a row is the
reference for every number.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from tests import megatron_shim  # noqa: E402
from tests.gloo_ranks import join_group, leave_group, run_ranks  # noqa: E402
from tests.numerics import ADAMW_WEIGHT_ATOL  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.torch_backend import TorchBackend  # noqa: E402
from vime.runtime.ports import free_port  # noqa: E402

ALGORITHM = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}


def _tp2_worker(rank: int, port: int, model_dir: str, work: str) -> None:
    """One of the two TP ranks: load checkpoint A (saved at TP=1), train B, save checkpoints, report."""
    join_group(rank, port, megatron_shim=True)
    from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_model import Parallelism

    backend = MegatronBackend(
        trainer_spec(model_dir, **ALGORITHM), megatron_spec(model_dir, parallel=Parallelism(tensor=2))
    )
    local = backend.gpt.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
    backend.load_training_state(os.path.join(work, "ckpt_a"))
    metrics = backend.train_rollout(make_samples(1), 0)
    backend.save_training_state(os.path.join(work, "ckpt_b"))
    backend.megatron.ckpt_format = "torch"
    backend.save_training_state(os.path.join(work, "ckpt_b_torch"))
    weights = {n: t.clone() for n, t in backend.hf_named_weights()}
    if rank == 0:
        torch.save(
            {
                "metrics": metrics,
                "weights": weights,
                "local_qkv_rows": local,
                "rollouts_trained": backend.rollouts_trained,
            },
            os.path.join(work, "tp2.pt"),
        )
    leave_group()


def test_tensor_parallel_2_step_and_checkpoints_across_tp(tmp_path):
    from tests.unit.test_megatron_backend import (
        assert_same_metrics,
        assert_same_weights,
        make_samples,
        megatron_spec,
        trainer_spec,
    )
    from vime.backends.megatron_checkpoint import MegatronCheckpointError

    megatron_shim.install()
    model_dir = megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path / "model"))
    reference = TorchBackend(trainer_spec(model_dir, **ALGORITHM))
    tp1 = MegatronBackend(trainer_spec(model_dir, **ALGORITHM), megatron_spec(model_dir))
    assert_same_metrics(tp1.train_rollout(make_samples(0), 0), reference.train_rollout(make_samples(0), 0))
    tp1.save_training_state(str(tmp_path / "ckpt_a"))

    run_ranks(_tp2_worker, (free_port(), model_dir, str(tmp_path)), 2)
    tp2 = torch.load(tmp_path / "tp2.pt", weights_only=False)
    assert tp2["local_qkv_rows"] * 2 == tp1.gpt.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
    assert tp2["rollouts_trained"] == 2
    # Rollout B at TP=2 (after a TP=1 -> TP=2 reshard of weights and AdamW moments) = the torch backend's.
    assert_same_metrics(tp2["metrics"], reference.train_rollout(make_samples(1), 0))
    for name, tensor in reference.model.named_parameters():
        torch.testing.assert_close(tp2["weights"][name], tensor.detach(), rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)

    # TP=2 -> TP=1: the torch_dist checkpoint loads; the torch one refuses with the reason.
    resumed = MegatronBackend(trainer_spec(model_dir, **ALGORITHM), megatron_spec(model_dir))
    resumed.load_training_state(str(tmp_path / "ckpt_b"))
    for name, tensor in resumed.hf_named_weights():
        assert torch.equal(tensor, tp2["weights"][name]), name
    assert_same_metrics(resumed.train_rollout(make_samples(2), 0), reference.train_rollout(make_samples(2), 0))
    assert_same_weights(resumed, reference.model)
    with pytest.raises(MegatronCheckpointError, match="torch_dist"):
        resumed.load_training_state(str(tmp_path / "ckpt_b_torch"))
    # ... but the converter merges its two tensor-parallel shards.
    from vime.backends.megatron_convert import read_hf_state_dict
    from vime.tools.convert_checkpoint import megatron_to_hf

    megatron_to_hf(str(tmp_path / "ckpt_b_torch"), str(tmp_path / "hf_b"), model_dir, dtype="float32")
    merged = read_hf_state_dict(str(tmp_path / "hf_b"))
    assert merged.keys() == tp2["weights"].keys()
    assert all(torch.equal(merged[n], tp2["weights"][n]) for n in merged)
