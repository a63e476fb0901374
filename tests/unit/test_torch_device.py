"""Where the torch backend trains (vime.backends.torch_backend.training_device) and what moves between the
device and the CPU: the micro-batch to the device, the forward's results back (vime.rl.batch), the random
generators' states with a checkpoint (vime.backends.random_state). On CUDA itself: tests/gpu/check_torch_cuda.py."""

import random

import numpy as np
import pytest
import torch

from vime.backends.random_state import restore_rng_state, rng_state
from vime.backends.torch_backend import training_device
from vime.rl.batch import Forward, PackedBatch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@no_cuda
def test_a_rank_without_a_gpu_trains_on_the_cpu():
    assert training_device(None) == torch.device("cpu")
    assert training_device("cpu") == torch.device("cpu")


@no_cuda
def test_cuda_asked_for_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        training_device("cuda")


def test_an_unknown_device_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'cpu' or 'cuda', not 'tpu'"):
        training_device("tpu")


def batch() -> PackedBatch:
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    return PackedBatch(
        input_ids=ids,
        attention_mask=(ids != 0).long(),
        targets=ids[:, 1:],
        response_mask=torch.ones(2, 3),
        rollout_log_probs=torch.full((2, 3), -0.5),
        starts=[1, 1],
        lengths=[1, 2],
        head_ids=torch.zeros(2, 3, 2, dtype=torch.long),
    )


def test_a_batch_already_on_the_device_is_not_copied():
    packed = batch()
    assert packed.to(torch.device("cpu")) is packed


def test_a_batch_moves_every_tensor_and_keeps_the_rest():
    packed = batch()
    moved = packed.to(torch.device("meta"))  # a device without data: where each tensor went is what is checked
    tensors = [name for name, value in vars(packed).items() if isinstance(value, torch.Tensor)]
    assert set(tensors) >= {"input_ids", "attention_mask", "targets", "response_mask", "rollout_log_probs", "head_ids"}
    for name in tensors:
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(packed, name).device.type == "cpu", name  # the original is left as it was
    assert moved.starts == [1, 1] and moved.lengths == [1, 2]
    assert moved.head_log_probs is None and moved.teacher_log_probs is None


def test_the_forward_comes_back_differentiable():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = Forward(log_probs * 2, entropy=None, head_log_probs=log_probs[..., None]).to(torch.device("meta"))
    assert out.log_probs.device.type == "meta" and out.head_log_probs.device.type == "meta"
    assert out.entropy is None
    back = Forward(log_probs * 2).to(torch.device("cpu"))
    back.log_probs.sum().backward()
    assert log_probs.grad.tolist() == [[2.0, 2.0]]


def test_the_random_generators_resume_where_they_were_saved():
    state = rng_state()
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.random(), np.random.rand(), torch.rand(())  # the run goes on past the checkpoint
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == drawn
