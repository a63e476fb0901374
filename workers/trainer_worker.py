"""Trainer worker (a Ray actor): reads accepted groups by reference, trains, publishes weights.

The trainer holds the only copy of the optimizer state between checkpoints. On crash, the run
resumes from the last checkpoint (model, optimizer, RNG and the queue cursor of the same step) and
retrains the accepted groups after that cursor: training is exactly-once per surviving lineage.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time

from straw.errors import CorruptData, InvalidReference

from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.queue.tasks import AcceptedGroup
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import make_transport
from vime.recovery.faults import fault_point
from vime.sample import Sample
from vime.weights import disk


class CorruptGroup(RuntimeError):
    """An accepted group's payload does not verify; the run stops rather than train on it."""


@dataclasses.dataclass(kw_only=True)
class TrainerWorkerSpec:
    backend: TorchTrainerSpec
    transport: str
    store: StoreOptions
    io_concurrency: int = 1
    weight_dir: str
    keep_weight_versions: int


class TrainerWorker:
    def __init__(self, spec: TrainerWorkerSpec):
        self.spec = spec
        self.backend = TorchBackend(spec.backend)
        # One transport (store handle) per reader thread: a straw handle serialises its calls.
        self.readers = [make_transport(spec.transport, spec.store) for _ in range(max(1, spec.io_concurrency))]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.readers),
                                                          thread_name_prefix="queue-read")

    def ready(self) -> bool:
        return True

    def _read_group(self, index: int, group: AcceptedGroup) -> list[Sample]:
        try:
            members = self.readers[index % len(self.readers)].read(group.ref)
        except (CorruptData, InvalidReference) as error:
            raise CorruptGroup(f"accepted group {group.task_id} (queue position {group.position}) cannot be "
                               f"read: {type(error).__name__}: {error}. It was not trained; the payload on disk "
                               "fails its checksum or was reclaimed") from None
        return sorted(members, key=lambda s: s.index)

    def read_groups(self, groups: list[AcceptedGroup]) -> list[Sample]:
        """All samples of ``groups``, in group order (--rollout-io-concurrency reads at once)."""
        batches = [groups[i::len(self.readers)] for i in range(len(self.readers))]
        read = self.pool.map(lambda i: [self._read_group(i, g) for g in batches[i]], range(len(self.readers)))
        by_position = {g.position: members for batch, result in zip(batches, read) for g, members in zip(batch, result)}
        return [sample for group in groups for sample in by_position[group.position]]

    def train_rollout(self, rollout_id: int, groups: list[AcceptedGroup], policy_version: int) -> dict[str, float]:
        """Train on one rollout's groups with the policy at ``policy_version``; returns its metrics."""
        started = time.perf_counter()
        samples = self.read_groups(groups)
        read_seconds = time.perf_counter() - started
        fault_point("trainer.mid_step")
        metrics = self.backend.train_rollout(samples, policy_version)
        staleness = [policy_version - min(s.weight_versions) for s in samples if s.weight_versions]
        metrics.update(
            rollout_id=float(rollout_id),
            reward_mean=statistics.fmean(s.reward for s in samples),
            response_length_mean=statistics.fmean(s.response_length for s in samples),
            staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
            staleness_max=float(max(staleness, default=0)),
            samples=float(len(samples)),
            groups=float(len(groups)),
            read_seconds=read_seconds,
            truncated_fraction=sum(s.status.value == "truncated" for s in samples) / len(samples),
        )
        return metrics

    def publish_weights(self, version: int) -> str:
        path = disk.publish_full(self.spec.weight_dir, version, self.backend.save_weights)
        keep = set(range(version - self.spec.keep_weight_versions, version + 1))
        disk.prune(self.spec.weight_dir, keep)
        return path

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_training_state(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_training_state(path)

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(path)

    def shutdown(self) -> None:
        self.pool.shutdown()
        for reader in self.readers:
            reader.close()
