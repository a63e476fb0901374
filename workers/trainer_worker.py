"""Trainer worker (a Ray actor): reads accepted groups by reference, trains, publishes weights.

The trainer holds the only copy of the optimizer state between checkpoints. On crash, the run
resumes from the last checkpoint (model, optimizer, RNG and the queue cursor of the same step) and
retrains the accepted groups after that cursor: training is exactly-once per surviving lineage.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from straw.errors import CorruptData, InvalidReference

from vime.backends.trainer_spec import TorchTrainerSpec
from vime.errors import UserError
from vime.queue.rollout_queue import StoreOptions
from vime.queue.tasks import AcceptedGroup
from vime.queue.transport import GroupTransport, make_transport
from vime.recovery.faults import fault_point
from vime.recovery.lineage import Lineage
from vime.rollout.rewards import reward_by_source
from vime.runtime.log_hooks import RolloutLogHook, hook_fields
from vime.sample import Sample
from vime.weights.publisher import Publication, WeightPublisher

if TYPE_CHECKING:  # the annotation's name only: from_settings loads the module when a run trains with Megatron
    from vime.backends.megatron_spec import MegatronBackendSpec


def tokens_per_version(samples: list[Sample]) -> dict[str, int]:
    """Trained response tokens by the weight version that generated them (keys are versions)."""
    counts = collections.Counter(v for s in samples for v in s.weight_versions)
    return {str(version): counts[version] for version in sorted(counts)}


# The step's metrics computed from its samples (and the driver's rollout throughput): what a
# --custom-rollout-log-function-path that logged the rollout itself keeps out of the trackers.
ROLLOUT_METRICS = (
    "reward_mean",
    "response_length_mean",
    "truncated_fraction",
    "staleness_mean",
    "staleness_max",
    "tokens_per_version",
    "rollout_tokens_per_s",
)


class CorruptGroup(UserError, RuntimeError):
    """An accepted group's payload does not verify; the run stops rather than train on it."""


@dataclasses.dataclass(kw_only=True)
class TrainerWorkerSpec:
    backend: TorchTrainerSpec
    megatron: MegatronBackendSpec | None = None  # --train-backend megatron: the Megatron backend's own spec
    transport: str
    store: StoreOptions
    io_concurrency: int = 1
    weight_dir: str
    keep_weight_versions: int
    delta_encoding: str = "xor"  # --update-weight-delta-encoding
    delta_checksum: str | None = None  # --update-weight-delta-checksum, as usable here
    weight_buffer_bytes: int = 0  # --update-weight-buffer-size: NCCL broadcast buckets (0: one per tensor)
    weight_scratch_dir: str | None = None  # --update-weight-trainer-dir: the delta parent's folder (<dir>/trainer)
    hook_args: argparse.Namespace | None = None  # the run's args, as --custom-rollout-log-function-path gets them

    @classmethod
    def from_settings(
        cls, s, *, transport: str, store: StoreOptions, threads: int | None, cpu_affinity: list[int] | None
    ) -> TrainerWorkerSpec:
        """The trainer of a ``vime train`` run (also what debug replay rebuilds, so both agree)."""
        from vime.backends.lr_schedule import lr_schedule_from_settings
        from vime.config.hooks import load_custom_config

        backend = TorchTrainerSpec(
            hf_checkpoint=s.train.hf_checkpoint,
            lr=s.train.lr,
            weight_decay=s.train.weight_decay,
            adam_betas=(s.train.adam_beta1, s.train.adam_beta2),
            adam_eps=s.train.adam_eps,
            clip_grad=s.train.clip_grad,
            micro_batch_size=s.train.micro_batch_size,
            global_batch_size=s.global_batch_size,
            n_samples_per_prompt=s.rollout.n_samples_per_prompt,
            rollout_temperature=s.rollout.rollout_temperature,
            algorithm=s.algorithm,
            seed=s.run.seed,
            threads=threads,
            cpu_affinity=cpu_affinity,
            lr_schedule=lr_schedule_from_settings(s),
            bf16=s.train.bf16,
            engine_dtype=s.vllm.vllm_args.get("dtype"),
            use_distributed_optimizer=s.train.use_distributed_optimizer,
            log_probs_chunk_size=s.train.log_probs_chunk_size,
            recompute_granularity=s.megatron.recompute_granularity,
            use_dynamic_batch_size=s.train.use_dynamic_batch_size,
            max_tokens_per_gpu=s.train.max_tokens_per_gpu,
            log_probs_max_tokens_per_gpu=s.train.log_probs_max_tokens_per_gpu,
            balance_data=s.train.balance_data,
            optimizer=s.train.optimizer,
            sgd_momentum=s.train.sgd_momentum,
            check_for_nan_in_loss_and_grad=not s.train.no_check_for_nan_in_loss_and_grad,
            deterministic_mode=s.perf.deterministic_mode,
            exp_avg_dtype=s.perf.exp_avg_dtype,
            exp_avg_sq_dtype=s.perf.exp_avg_sq_dtype,
            hooks=s.hooks,
            custom_config=load_custom_config(s.hooks.custom_config_path),
        )
        megatron = None
        if s.train.train_backend == "megatron":
            from vime.backends.megatron_spec import MegatronBackendSpec

            megatron = MegatronBackendSpec.from_settings(s)
        return cls(
            backend=backend,
            megatron=megatron,
            transport=transport,
            store=store,
            io_concurrency=s.queue.rollout_io_concurrency,
            weight_dir=s.weight_dir,
            keep_weight_versions=s.weights.keep_weight_versions,
            delta_encoding=s.weights.update_weight_delta_encoding,
            delta_checksum=s.weights.delta_checksum(),
            weight_buffer_bytes=s.weights.update_weight_buffer_size,
            weight_scratch_dir=(
                os.path.join(s.weights.update_weight_trainer_dir, "trainer")
                if s.weights.update_weight_trainer_dir
                else None
            ),
            hook_args=s.args,
        )


def _assigned_gpu() -> int:
    """The CUDA index of the GPU Ray gave this rank: 0 when Ray narrowed CUDA_VISIBLE_DEVICES to it, its id
    when Ray left the variable alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1)."""
    import ray

    ids = [str(int(i)) for i in ray.get_gpu_ids()]
    if not ids or os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") == ids:
        return 0
    return int(ids[0])


class TrainerWorker:
    """One rank of the trainer. With several ranks (``--actor-num-nodes`` x ``--actor-num-gpus-per-node``) every
    rank reads and trains on the same groups (the backend shares out the work, docs/parallelism.md) and rank 0
    alone writes weights and answers for the group; ``join`` forms the ranks' process group first."""

    def __init__(self, spec: TrainerWorkerSpec, *, rank: int = 0, world_size: int = 1):
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.backend = self._build_backend() if world_size == 1 else None
        # One transport (store handle) per reader thread: a straw handle serialises its calls.
        self.readers = [make_transport(spec.transport, spec.store) for _ in range(max(1, spec.io_concurrency))]
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.readers), thread_name_prefix="queue-read"
        )
        self.publisher: WeightPublisher | None = None  # built at the first publication
        log_path = spec.backend.hooks.custom_rollout_log_function_path if spec.backend.hooks else None
        self.rollout_log = RolloutLogHook(log_path, spec.hook_args) if log_path and rank == 0 else None
        self.sender = None  # NcclWeightSender with --update-weight-transport nccl
        self.nccl_metadata: list = []  # what the engines receive, in broadcast order

    def _build_backend(self):
        if self.spec.megatron is not None:
            from vime.backends.megatron_backend import MegatronBackend

            return MegatronBackend(self.spec.backend, self.spec.megatron)
        from vime.backends.torch_backend import TorchBackend  # torch: in the ranks, not in the driver

        return TorchBackend(self.spec.backend)

    def rendezvous_endpoint(self) -> tuple[str, int]:
        """(address, free port) on this node: rank 0 serves the trainer group's rendezvous there."""
        import ray

        from vime.runtime.ports import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def join(self, address: str, port: int, timeout_seconds: float) -> bool:
        """Form the trainer's process group with the other ranks (every rank calls it at once), then build
        the backend inside it. ``timeout_seconds`` also bounds every collective of the run."""
        import datetime

        import torch
        import torch.distributed as dist

        # Both backends train on the rank's GPU where it has one. Megatron's collectives are all on the GPU
        # (NCCL); the torch backend also exchanges CPU tensors (metrics, the objective's terms): gloo for those.
        backend = "gloo"
        if torch.cuda.is_available():
            backend = "nccl" if self.spec.megatron is not None else "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(_assigned_gpu())
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_seconds),
        )
        self.backend = self._build_backend()
        return True

    def ready(self) -> bool:
        return True

    def _read_group(self, read: Callable[[Any], list[Sample]], group: AcceptedGroup) -> list[Sample]:
        try:
            members = read(group.ref)
        except (CorruptData, InvalidReference) as error:
            raise CorruptGroup(
                f"accepted group {group.task_id} (queue position {group.position}) cannot be "
                f"read: {type(error).__name__}: {error}. It was not trained; the payload on disk "
                "fails its checksum or was reclaimed"
            ) from None
        return sorted(members, key=lambda s: s.index)

    def _read_share(self, reader: GroupTransport, groups: list[AcceptedGroup]) -> list[list[Sample]]:
        with reader.reading() as read:
            return [self._read_group(read, g) for g in groups]

    def read_groups(self, groups: list[AcceptedGroup]) -> list[Sample]:
        """All samples of ``groups``, in group order (--rollout-io-concurrency readers at once, each reading its
        share in one read session)."""
        shares = [groups[i :: len(self.readers)] for i in range(len(self.readers))]
        read = self.pool.map(self._read_share, self.readers, shares)
        by_position = {g.position: members for share, result in zip(shares, read) for g, members in zip(share, result)}
        return [sample for group in groups for sample in by_position[group.position]]

    def train_rollout(
        self,
        rollout_id: int,
        groups: list[AcceptedGroup],
        policy_version: int,
        lineage: Lineage | None = None,
        rollout_time: float = 0.0,
    ) -> dict[str, float]:
        """Train on one rollout's groups with the policy at ``policy_version``; returns its metrics.
        ``lineage``: the run's restores in place, so that staleness counts steps, not version numbers;
        ``rollout_time``: what --custom-rollout-log-function-path is told the rollout took."""
        started = time.perf_counter()
        samples = self.read_groups(groups)
        read_seconds = time.perf_counter() - started
        logged = self.rollout_log(rollout_id, samples, rollout_time) if self.rollout_log else None
        fault_point("trainer.mid_step")
        metrics = self.backend.train_rollout(samples, policy_version)
        self._save_debug_train_data(rollout_id)
        lineage = lineage or Lineage()
        staleness = [lineage.staleness(policy_version, min(s.weight_versions)) for s in samples if s.weight_versions]
        metrics.update(
            rollout_id=float(rollout_id),
            reward_mean=statistics.fmean(s.reward or 0.0 for s in samples),  # SFT samples carry no reward
            response_length_mean=statistics.fmean(s.response_length for s in samples),
            staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
            staleness_max=float(max(staleness, default=0)),
            samples=float(len(samples)),
            groups=float(len(groups)),
            read_seconds=read_seconds,
            truncated_fraction=sum(s.status.value == "truncated" for s in samples) / len(samples),
        )
        metrics["tokens_per_version"] = tokens_per_version(samples)
        by_source = reward_by_source(samples) if len({s.source_name for s in samples}) > 1 else {}
        metrics.update(by_source)  # one source: reward_mean says it all
        if logged is not None:
            metrics.update(hook_fields(*logged, defaults=[*ROLLOUT_METRICS, *by_source]))
        return metrics

    def log_rollout(
        self, rollout_id: int, groups: list[AcceptedGroup], rollout_time: float, defaults: list[str]
    ) -> dict[str, Any]:
        """--custom-rollout-log-function-path on a step that is not trained (--debug-rollout-only): rank 0 reads
        the step's samples and calls the hook as a training step would; the record's fields it adds (``defaults``:
        the record's own metrics of that data, left out of the trackers when the hook logged it itself)."""
        if self.rollout_log is None:
            return {}
        logged = self.rollout_log(rollout_id, self.read_groups(groups), rollout_time)
        return hook_fields(*logged, defaults=defaults)

    def _save_debug_train_data(self, rollout_id: int) -> None:
        """--save-debug-train-data: rank 0 writes the step's training data (the backend kept it)."""
        template = self.spec.backend.hooks.save_debug_train_data if self.spec.backend.hooks else None
        data = getattr(self.backend, "last_train_data", None)
        if not template or data is None or self.rank != 0:
            return
        import torch

        path = template.format(rollout_id=rollout_id, rank=self.rank)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"rollout_id": rollout_id, **data}, path)

    # ------------------------------------------------------------------ weights (docs/weights.md)
    def publish_weights(
        self, version: int, *, mode: str = "full", full_interval: int = 10, force_full: bool = False
    ) -> Publication | None:
        """Write ``weight_v{N}/``: the full weights, or (mode "delta") a delta against the version this
        process published just before, when there is one; older versions are pruned. Rank 0 writes; the
        other ranks take part in gathering the weights and return None."""
        if self.rank != 0:
            self.backend.export_peer()
            return None
        if self.publisher is None:
            self.publisher = WeightPublisher(
                self.spec.weight_dir,
                keep=self.spec.keep_weight_versions,
                scratch=self.spec.weight_scratch_dir,
                encoding=self.spec.delta_encoding,
                checksum=self.spec.delta_checksum,
            )
        return self.publisher.publish(
            version, self.backend.save_weights, mode=mode, full_interval=full_interval, force_full=force_full
        )

    def _named_weights(self) -> list:
        """What the engines load: the model's parameters (a tied one once, under its first name)."""
        hf_named = getattr(self.backend, "hf_named_weights", None)  # the Megatron backend renames to HF's
        return hf_named() if hf_named is not None else list(self.backend.model.named_parameters())

    def nccl_endpoint(self) -> tuple[str, int]:
        """(address, free port) on this node for the NCCL group's rendezvous (the trainer is rank 0)."""
        import ray

        from vime.runtime.ports import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def nccl_open(self, address: str, port: int, world_size: int) -> str:
        """Open the group as rank 0 (blocks until every engine worker joined); returns the metadata
        (names, dtypes, shapes, in broadcast order) the engines receive by."""
        from vime.weights import nccl

        if self.rank != 0:
            self.backend.export_peer()
            return ""
        self.sender = nccl.NcclWeightSender()
        self.sender.open(address, port, world_size)
        self.nccl_metadata = nccl.tensor_metadata(self._named_weights())
        return nccl.encode_metadata(self.nccl_metadata)

    def nccl_close(self) -> None:
        """Leave the weight group (the driver re-forms it when the engines change)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def nccl_send(self) -> dict[str, float]:
        """Broadcast the current weights in the order of the metadata sent at ``nccl_open`` (each
        tensor checked against it); the engines receive them at the same time."""
        if self.rank != 0:
            self.backend.export_peer()
            return {}
        started = time.perf_counter()
        report = self.sender.send(self._named_weights(), self.nccl_metadata, bucket_bytes=self.spec.weight_buffer_bytes)
        return {**report, "seconds": time.perf_counter() - started}

    # ------------------------------------------------------------------ colocated memory (--offload-train)
    def offload_memory(self) -> None:
        """The engines generate next: release this rank's device memory (docs/real-models.md)."""
        self.backend.offload()

    def reload_memory(self) -> None:
        """Training comes next: take the memory :meth:`offload_memory` released back."""
        self.backend.reload()

    def save_checkpoint(self, path: str) -> None:
        fault_point("trainer.mid_save")  # tests: a slow checkpoint write, for kills to land in
        self.backend.save_training_state(path)

    def load_checkpoint(self, path: str, *, optimizer: bool = True) -> None:
        self.backend.load_training_state(path, optimizer=optimizer)

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(path)

    def shutdown(self) -> None:
        self.pool.shutdown()
        if self.sender is not None:
            self.sender.close()
        if self.publisher is not None:
            self.publisher.close()
        for reader in self.readers:
            reader.close()
