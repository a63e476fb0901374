"""Megatron-LM's --deterministic-mode, on both backends: the trainer process runs deterministic kernels only
(torch.use_deterministic_algorithms, cuDNN without autotuning, cuBLAS's fixed workspace on CUDA), and on the
Megatron backend megatron-core's TransformerConfig.deterministic_mode is set. The setting is per process: every
test here restores torch's global state afterwards, so that the other tests of this worker run as before."""

import dataclasses
import os

import pytest
import torch

from tests.unit.test_rl_torch_backend import backend, make_samples, model, model_dir  # noqa: F401 (fixtures)
from vime.backends.torch_backend import TorchBackend


@pytest.fixture
def restored_determinism():
    """torch's deterministic switch, cuDNN's flags and CUBLAS_WORKSPACE_CONFIG as they were before the test."""
    state = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    enabled, cudnn_deterministic, cudnn_benchmark, workspace = state
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def test_the_torch_trainer_switches_to_deterministic_kernels_and_repeats_its_steps_bit_for_bit(
    model_dir,  # noqa: F811
    model,  # noqa: F811
    restored_determinism,
):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    plain = backend(model_dir)
    assert not torch.are_deterministic_algorithms_enabled()  # the flag left out changes nothing
    runs = []
    for _ in range(2):
        trainer = TorchBackend(dataclasses.replace(plain.spec, deterministic_mode=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        metrics = [trainer.train_rollout(make_samples(model, seed=seed), policy_version=0) for seed in (0, 1)]
        runs.append((metrics, [p.detach().clone() for p in trainer.model.parameters()]))
    (first, first_weights), (second, second_weights) = runs
    for ours, theirs in zip(first, second, strict=True):
        assert {k: v for k, v in ours.items() if k != "train_seconds"} == {
            k: v for k, v in theirs.items() if k != "train_seconds"
        }
    for ours, theirs in zip(first_weights, second_weights, strict=True):
        assert torch.equal(ours, theirs)
    assert any(not torch.equal(a, b) for a, b in zip(first_weights, plain.model.parameters()))  # they trained


def test_a_user_s_cublas_workspace_is_kept(model_dir, restored_determinism):  # noqa: F811
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    TorchBackend(dataclasses.replace(backend(model_dir).spec, deterministic_mode=True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_megatron_backend_sets_megatron_core_s_deterministic_mode(tmp_path, restored_determinism):
    pytest.importorskip("megatron.core")
    from tests import megatron_shim
    from tests.unit.test_megatron_backend import make_samples as megatron_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_backend import MegatronBackend
    from vime.config.megatron_perf import MegatronPerfConfig

    megatron_shim.install()
    qwen2_dir = megatron_shim.tiny_hf_model(str(tmp_path), "qwen2")
    spec = dataclasses.replace(trainer_spec(qwen2_dir), deterministic_mode=True)
    overrides = MegatronPerfConfig(deterministic_mode=True).transformer_fields()
    trainer = MegatronBackend(spec, megatron_spec(qwen2_dir, config_overrides=overrides))
    assert trainer.gpt.config.deterministic_mode and torch.are_deterministic_algorithms_enabled()
    assert trainer.train_rollout(megatron_samples(0), 0)["optimizer_steps"] >= 1


def test_the_flag_reaches_the_trainer_and_is_said_at_start_up(tmp_path):
    pytest.importorskip("megatron.core")
    from tests import megatron_shim
    from tests.train_args import minimal_train_argv
    from vime.backends.megatron_spec import MegatronBackendSpec
    from vime.config import parse_train_args
    from workers.trainer_worker import TrainerWorkerSpec

    qwen2_dir = megatron_shim.tiny_hf_model(str(tmp_path), "qwen2")
    for extra, deterministic in (([], False), (["--deterministic-mode"], True)):
        settings = parse_train_args(minimal_train_argv(qwen2_dir, *extra))
        spec = TrainerWorkerSpec.from_settings(settings, transport="memory", store=None, threads=1, cpu_affinity=None)
        assert spec.backend.deterministic_mode is deterministic
        assert settings.args.deterministic_mode is deterministic  # Megatron-LM's name, for hooks
        notes = [n for n in settings.perf.startup_notes("megatron") if n.startswith("--deterministic-mode")]
        assert len(notes) == deterministic and all("megatron-core's deterministic_mode" in n for n in notes)
        overrides = MegatronBackendSpec.from_settings(settings).config_overrides or {}
        assert overrides.get("deterministic_mode", False) is deterministic
