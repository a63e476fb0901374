"""The run's controller: the one owner of the task queue (a Ray actor, restartable).

It refills prompts from the dataset (the dataset cursor moves in the same journal transaction as
the submission), hands leases to rollout workers under the staleness admission bound, accepts
their groups exactly once, and feeds accepted groups to the trainer in order. Calls are served
one at a time (Ray's default actor concurrency), which is what straw's single-writer Coordinator
needs.

On crash: the fence is released with the process; a new controller recovers the queue from its
journal, every lease of the dead incarnation is fenced and its task returns to the queue.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from straw import Record

from vime.data.source import DataKeys, DatasetCursor, PromptDataset, PromptRecord
from vime.queue.fence import QueueFence
from vime.queue.gc import reap_writers, writer_ids
from vime.recovery.faults import fault_point
from vime.queue.memory_queue import MemoryRolloutQueue
from vime.queue.rollout_queue import StaleLease, StoreOptions, StrawRolloutQueue
from vime.queue.tasks import AcceptedGroup, Assignment, PromptTask


@dataclasses.dataclass(kw_only=True)
class ControllerSpec:
    transport: str                  # straw | object-store
    store: StoreOptions
    lease_seconds: float
    prompt_data: str
    keys: DataKeys
    seed: int
    shuffle: bool
    num_epoch: int | None
    groups_per_rollout: int         # --rollout-batch-size
    max_staleness: int


@dataclasses.dataclass(frozen=True)
class LeasedPrompt:
    """What a rollout worker receives: the task, its lease, the prompt and a durable prefix if any."""

    assignment: Assignment
    prompt: PromptRecord
    version: int          # weights the engines serve at lease time


@dataclasses.dataclass
class ControllerStats:
    weight_version: int
    pending: int
    leased: int
    accepted: int
    consumed: int
    failed: int
    accepted_response_tokens: int
    accepted_samples: int
    end_of_data: bool
    reclaimed_bytes: int

    @property
    def queue_depth(self) -> int:
        """Accepted groups waiting for the trainer."""
        return self.accepted - self.consumed


class Controller:
    def __init__(self, spec: ControllerSpec):
        self.spec = spec
        self.incarnation = f"controller-{uuid.uuid4().hex[:12]}"
        self.dataset = PromptDataset.load(spec.prompt_data, spec.keys)
        self.fence = None
        if spec.transport == "straw":
            self.fence = QueueFence.acquire(spec.store.data_dir)
            self.queue = StrawRolloutQueue.open(spec.store, owner=self.incarnation, lease_seconds=spec.lease_seconds)
        else:
            self.queue = MemoryRolloutQueue(lease_seconds=spec.lease_seconds)
        state = self.queue.dataset_cursor() or {}
        self.cursor = DatasetCursor(state.get("epoch", 0), state.get("offset", 0))
        self.next_group_index = state.get("next_group_index", 0)
        self.consumer_token = self.queue.open_consumer(self.incarnation)
        # Groups handed to the trainer. The driver owns the real cursor and states it with every
        # take_groups()/sync() call (a restarted controller learns it from the next call); until then
        # the queue's committed cursor is the best lower bound.
        self.consumed = self.queue.consumer_cursor()
        self.accepted = self._count_accepted()
        self.weight_version = 0
        self.accepted_response_tokens = 0
        self.accepted_samples = 0
        self.reclaimed_bytes = 0
        self._refill()

    # ------------------------------------------------------------------ lifecycle
    def ready(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "consumed": self.consumed, "accepted": self.accepted,
                "dataset_size": len(self.dataset)}

    def shutdown(self) -> None:
        self.queue.close()
        if self.fence is not None:
            self.fence.release()

    def _count_accepted(self) -> int:
        # History before the committed cursor may already be reclaimed; count from there.
        cursor = total = self.queue.consumer_cursor()
        while True:
            groups, cursor = self.queue.accepted(cursor, 1000)
            if not groups:
                return total
            total = groups[-1].position + 1

    # ------------------------------------------------------------------ prompts
    def _refill(self) -> None:
        """Keep about two rollouts' worth of fresh prompts pending (and never run dry)."""
        pending = sum(1 for t in self.queue.pending() if t.stage == "fresh")
        want = 2 * self.spec.groups_per_rollout - pending
        if want <= 0:
            return
        taken = self.cursor.take(self.dataset, want, seed=self.spec.seed, shuffle=self.spec.shuffle,
                                 num_epoch=self.spec.num_epoch)
        if not taken:
            return
        tasks = [PromptTask.make(self.next_group_index + i, epoch, row) for i, (epoch, row) in enumerate(taken)]
        self.next_group_index += len(tasks)
        self.queue.submit(tasks, {"epoch": self.cursor.epoch, "offset": self.cursor.offset,
                                  "next_group_index": self.next_group_index})

    # ------------------------------------------------------------------ rollout workers
    def _admissible(self) -> int:
        """Groups that may still start without exceeding --max-staleness.

        A group leased now is trained at about step (consumed + outstanding) / B, while the policy
        is at version ``weight_version``; the bound keeps that at most max_staleness steps ahead.
        """
        counts = self.queue.counts()
        outstanding = counts.get("leased", 0) + (self.accepted - self.consumed)
        limit = (self.weight_version + self.spec.max_staleness + 1) * self.spec.groups_per_rollout
        return max(0, limit - self.consumed - outstanding)

    def lease(self, worker_id: str, max_tasks: int) -> list[LeasedPrompt]:
        self._refill()
        count = min(max_tasks, self._admissible())
        if count <= 0:
            return []
        assignments = self.queue.acquire(worker_id, count)
        return [LeasedPrompt(a, self.dataset[a.task.prompt_index], self.weight_version) for a in assignments]

    def heartbeat(self, leases: list) -> list[bool]:
        return self.queue.heartbeat(leases)

    def complete(self, lease, submission_id: str, ref, num_samples: int, response_tokens: int) -> int | None:
        """Accept a group. Returns its position, or None if the lease is stale (work discarded)."""
        try:
            position = self.queue.complete(lease, submission_id, ref)
        except StaleLease:
            return None
        if position >= self.accepted:
            self.accepted = position + 1
            self.accepted_samples += num_samples
            self.accepted_response_tokens += response_tokens
        return position

    def return_partial(self, lease, task: PromptTask, partial_ref) -> bool:
        try:
            self.queue.return_partial(lease, task, partial_ref, request_id=f"return-{uuid.uuid4().hex}")
            return True
        except StaleLease:
            return False

    def fail(self, lease, reason: str) -> bool:
        try:
            self.queue.fail(lease, reason, request_id=f"fail-{uuid.uuid4().hex}")
            return True
        except StaleLease:
            return False

    # ------------------------------------------------------------------ trainer
    def sync(self, weight_version: int, cursor: int) -> None:
        """The driver's view: every engine serves ``weight_version``, and the groups before
        ``cursor`` were handed to the trainer. Admission moves on with them. Idempotent."""
        self.weight_version = weight_version
        self.consumed = cursor

    def take_groups(self, cursor: int, count: int, weight_version: int, *,
                    allow_partial: bool = False) -> list[AcceptedGroup]:
        """The accepted groups at positions [cursor, cursor + count) in acceptance order, or []
        until that many exist (``allow_partial``: whatever exists, for the last step of the data).

        Every call restates the driver's view (as sync() does), so a restarted controller admits
        work again as soon as the trainer asks for it.
        """
        self.sync(weight_version, cursor)
        available = self.accepted - cursor
        if available <= 0 or (available < count and not allow_partial):
            return []
        groups, _ = self.queue.accepted(cursor, min(count, available))
        return groups

    def commit(self, step: int, cursor: int, step_cursors: list[int]) -> None:
        """Durably mark the accepted groups before ``cursor`` as trained by step ``step``.

        ``step_cursors[i]`` is the cursor after step i + 1 of the surviving lineage: which step
        trained which group, for inspection.
        """
        state_ref = None
        if isinstance(self.queue, StrawRolloutQueue):
            payload = json.dumps({"step": step, "cursor": cursor, "weight_version": self.weight_version,
                                  "step_cursors": step_cursors}).encode()
            state_ref = self.queue.store.publish([Record("consumer-state", payload, "json.v1")],
                                                 submission_id=f"consumer-state-{self.incarnation}-{step}")
        fault_point("controller.mid_commit")
        # Request ids are unique per incarnation: a resumed (older) lineage re-commits steps an
        # earlier one committed with other content, and a commit retried after a controller restart
        # comes from a new incarnation. The cursor may move backward (resuming an older checkpoint).
        self.queue.commit_consumer(self.consumer_token, cursor, state_ref,
                                   request_id=f"commit-{self.incarnation}-{step}-{cursor}")
        if self.spec.store.collect_online:
            report = self.queue.collect_garbage()
            self.reclaimed_bytes += report.get("reclaimed_bytes", 0)

    def history_available(self, cursor: int) -> bool:
        return self.queue.history_available(cursor)

    def reap_writers(self, alive: list[str]) -> dict[str, int]:
        """Release what dead producers published but never got accepted (every straw writer of
        this queue except ours and those in ``alive``)."""
        if not isinstance(self.queue, StrawRolloutQueue):
            return {}
        keep = set(alive) | {self.queue.store.writer_id}
        dead = [w for w in writer_ids(self.spec.store.data_dir) if w not in keep]
        return reap_writers(self.queue.store, self.spec.store.data_dir, dead)

    def stats(self) -> ControllerStats:
        counts = self.queue.counts()
        return ControllerStats(
            weight_version=self.weight_version, pending=counts.get("pending", 0), leased=counts.get("leased", 0),
            accepted=self.accepted, consumed=self.consumed, failed=counts.get("failed", 0),
            accepted_response_tokens=self.accepted_response_tokens, accepted_samples=self.accepted_samples,
            end_of_data=self._end_of_data(counts), reclaimed_bytes=self.reclaimed_bytes)

    def _end_of_data(self, counts: dict[str, int]) -> bool:
        exhausted = self.spec.num_epoch is not None and self.cursor.epoch >= self.spec.num_epoch
        return exhausted and counts.get("pending", 0) == 0 and counts.get("leased", 0) == 0
