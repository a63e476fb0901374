"""Megatron-LM's --check-for-nan-in-loss-and-grad, on by default on both backends: an optimizer step whose loss or
gradient norm is NaN or infinite is not taken (the weights and the optimizer's state stay as they were) and the
step raises a UserError naming the flag that trains on regardless, which stops the run with one line."""

import dataclasses
import math

import pytest
import torch

from tests.unit.test_rl_torch_backend import backend, make_samples, model, model_dir  # noqa: F401 (fixtures)
from vime.backends.rollout_training import NonFiniteStep, check_finite_step
from vime.backends.torch_backend import TorchBackend
from vime.errors import UserError


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_step_whose_loss_is_nan_is_not_taken_and_names_the_flag(model_dir, model):  # noqa: F811
    trainer = backend(model_dir)
    with torch.no_grad():
        trainer.model.lm_head.weight[3, 0] = float("nan")  # one bad weight: every log-softmax is NaN
    before = weights(trainer.model)
    with pytest.raises(NonFiniteStep, match="optimizer step 1 of this rollout: the loss is nan") as error:
        trainer.train_rollout(make_samples(model), policy_version=0)
    assert isinstance(error.value, UserError) and "--no-check-for-nan-in-loss-and-grad" in str(error.value)
    assert_same(weights(trainer.model), before)
    assert not trainer.actor.optimizer.state  # AdamW never stepped


def test_without_the_check_the_step_is_taken(model_dir, model):  # noqa: F811
    plain = backend(model_dir)
    trainer = TorchBackend(dataclasses.replace(plain.spec, check_for_nan_in_loss_and_grad=False))
    with torch.no_grad():
        trainer.model.lm_head.weight[3, 0] = float("nan")
    metrics = trainer.train_rollout(make_samples(model), policy_version=0)
    assert math.isnan(metrics["loss"])
    assert trainer.actor.optimizer.state and any(p.isnan().any() for p in trainer.model.parameters())


@pytest.mark.parametrize(
    "loss, norm, said",
    [(1.0, math.inf, "the gradient norm is inf"), (math.nan, math.nan, "the loss is nan and the gradient norm is nan")],
)
def test_the_gradient_norm_is_checked_too(loss, norm, said):
    with pytest.raises(NonFiniteStep, match=f"the critic's optimizer step 3 of this rollout: {said}"):
        check_finite_step("critic", 2, loss, norm)
    check_finite_step("actor", 0, 1.0, 2.0)  # finite: nothing to say


def test_the_megatron_backend_refuses_the_step_too(tmp_path):
    pytest.importorskip("megatron.core")
    from tests import megatron_shim
    from tests.unit.test_megatron_backend import make_samples as megatron_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_backend import MegatronBackend

    megatron_shim.install()
    qwen2_dir = megatron_shim.tiny_hf_model(str(tmp_path), "qwen2")
    trainer = MegatronBackend(trainer_spec(qwen2_dir), megatron_spec(qwen2_dir))
    with torch.no_grad():
        trainer.gpt.output_layer.weight[3, 0] = float("nan")
    before = weights(trainer.gpt)
    with pytest.raises(NonFiniteStep, match="the loss is nan"):
        trainer.train_rollout(megatron_samples(0), 0)
    assert_same(weights(trainer.gpt), before)


def test_the_flag_reaches_the_trainer_and_the_hooks_args(tmp_path):
    from tests.train_args import minimal_train_argv
    from vime.config import parse_train_args
    from workers.trainer_worker import TrainerWorkerSpec

    (tmp_path / "config.json").write_text("{}")
    for extra, checked in (([], True), (["--no-check-for-nan-in-loss-and-grad"], False)):
        settings = parse_train_args(minimal_train_argv(str(tmp_path), *extra))
        spec = TrainerWorkerSpec.from_settings(settings, transport="memory", store=None, threads=1, cpu_affinity=None)
        assert spec.backend.check_for_nan_in_loss_and_grad is checked
        assert settings.args.check_for_nan_in_loss_and_grad is checked  # Megatron-LM's name, for hooks
