"""The trainer's ranks as Ray actors (workers/trainer_group.py) with the Megatron backend at tensor
parallelism 2 and in two pipeline stages: the ranks form their gloo group, read the same groups from a real
straw queue, train, and publish and checkpoint with rank 0 writing while rank 1 takes part in the gathers.

megatron-core needs CUDA; the actors get the CPU shim (tests/megatron_shim.py) through Ray's
``worker_process_setup_hook``, the one place a test can reach into processes Ray starts.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import REPO
from tests.numerics import ADAMW_WEIGHT_ATOL

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings(
        "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
    ),
]


@pytest.fixture(scope="module")
def ray_with_shim():
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": "tests.megatron_shim.install", "env_vars": {"PYTHONPATH": REPO}},
    )
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("layout", [{"tensor": 2}, {"pipeline": 2}], ids=["tp2", "pp2"])
def test_megatron_model_parallel_ranks_train_publish_and_checkpoint_as_one(ray_with_shim, tmp_path, layout):
    from tests import megatron_shim
    from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_model import Parallelism
    from vime.backends.torch_backend import TorchBackend
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.tasks import AcceptedGroup
    from vime.queue.transport import StrawTransport
    from vime.recovery import checkpoint as ckpt
    from vime.workers.trainer_group import TrainerGroup
    from vime.workers.trainer_worker import TrainerWorkerSpec

    model_dir = megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path / "model"))
    store = StoreOptions(str(tmp_path / "queue"))
    writer = StrawTransport(store)
    samples = make_samples(0)
    groups = [
        AcceptedGroup(
            position=g,
            task_id=f"task-{g}",
            ref=writer.publish(
                [s for s in samples if s.group_index == g], task_id=f"task-{g}", attempt_id="a", submission_id=f"s{g}"
            ),
        )
        for g in sorted({s.group_index for s in samples})
    ]
    spec = TrainerWorkerSpec(
        backend=trainer_spec(model_dir),
        megatron=megatron_spec(model_dir, parallel=Parallelism(**layout)),
        transport="straw",
        store=store,
        weight_dir=str(tmp_path / "weights"),
        keep_weight_versions=2,
    )
    group = TrainerGroup.start(spec, 2, timeout=300)
    try:
        metrics = group.train_rollout(0, groups, 0)
        reference = TorchBackend(trainer_spec(model_dir))
        expected = reference.train_rollout(samples, 0)
        assert_same_metrics({k: v for k, v in metrics.items() if k in expected}, expected)
        assert metrics["groups"] == 2.0 and metrics["samples"] == len(samples)

        publication = group.publish_weights(1, mode="full", full_interval=10, force_full=False, timeout=300)
        from transformers import AutoModelForCausalLM

        published = dict(AutoModelForCausalLM.from_pretrained(publication.path, dtype=torch.float32).named_parameters())
        for name, param in reference.model.named_parameters():
            torch.testing.assert_close(published[name], param.detach(), rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)

        state = ckpt.CheckpointState(schema=1, step=1, weight_version=1, consumer_cursor=2, run_options={})
        folder = ckpt.save_checkpoint(
            str(tmp_path / "save"), state, lambda path: group.save_checkpoint(path, timeout=300)
        )
        assert "metadata.json" in os.listdir(folder)  # one torch_dist checkpoint of both shards
        group.load_checkpoint(folder, timeout=300)
    finally:
        group.kill()
    writer.close()


def test_torch_fsdp_ranks_train_publish_and_checkpoint_as_one(ray_with_shim, tmp_path):
    """--use-distributed-optimizer on the torch backend: two FSDP2 ranks as Ray actors. Rank 1 takes part in
    the weight gather (export_peer) while rank 0 publishes; both write the sharded checkpoint."""
    import dataclasses

    from tests import megatron_shim
    from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, trainer_spec
    from vime.backends.torch_backend import TorchBackend
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.tasks import AcceptedGroup
    from vime.queue.transport import StrawTransport
    from vime.recovery import checkpoint as ckpt
    from vime.workers.trainer_group import TrainerGroup
    from vime.workers.trainer_worker import TrainerWorkerSpec

    model_dir = megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path / "model"))
    store = StoreOptions(str(tmp_path / "queue"))
    writer = StrawTransport(store)
    samples = make_samples(0)
    groups = [
        AcceptedGroup(
            position=g,
            task_id=f"task-{g}",
            ref=writer.publish(
                [s for s in samples if s.group_index == g], task_id=f"task-{g}", attempt_id="a", submission_id=f"s{g}"
            ),
        )
        for g in sorted({s.group_index for s in samples})
    ]
    sharded = dataclasses.replace(trainer_spec(model_dir), use_distributed_optimizer=True)
    spec = TrainerWorkerSpec(
        backend=sharded, transport="straw", store=store, weight_dir=str(tmp_path / "weights"), keep_weight_versions=2
    )
    group = TrainerGroup.start(spec, 2, timeout=300)
    try:
        metrics = group.train_rollout(0, groups, 0)
        reference = TorchBackend(trainer_spec(model_dir))
        expected = reference.train_rollout(samples, 0)
        assert_same_metrics({k: v for k, v in metrics.items() if k in expected}, expected)

        publication = group.publish_weights(1, mode="full", full_interval=10, force_full=False, timeout=300)
        from transformers import AutoModelForCausalLM

        published = dict(AutoModelForCausalLM.from_pretrained(publication.path, dtype=torch.float32).named_parameters())
        for name, param in reference.model.named_parameters():
            torch.testing.assert_close(published[name], param.detach(), rtol=0, atol=1e-6, msg=name)

        state = ckpt.CheckpointState(schema=1, step=1, weight_version=1, consumer_cursor=2, run_options={})
        folder = ckpt.save_checkpoint(
            str(tmp_path / "save"), state, lambda path: group.save_checkpoint(path, timeout=300)
        )
        assert {"sharded", "trainer_state.pt"} <= set(os.listdir(folder))
        group.load_checkpoint(folder, timeout=300)
    finally:
        group.kill()
    writer.close()
