"""The run's task queue on straw: prompts in, accepted groups out, every transition journaled.

Owned by exactly one controller at a time (see ``queue/fence.py``); rollout workers and the
trainer reach it only through the controller and carry references, never payloads.
Exactly-once acceptance comes from straw: a completion is keyed by a submission id, so a retried
completion returns the original receipt and different content for the same attempt is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from collections.abc import Callable
from typing import Any

from straw import Coordinator, RecordSetRef, SharedFilesystemStore, TaskSpec
from straw.backend import FilesystemBackend
from straw.errors import IdempotencyConflict, InvalidReference, LeaseExpired, StaleAttempt

from vime.errors import MemberDied
from vime.queue.journal_view import JournalView
from vime.queue.records import CODECS
from vime.queue.tasks import (
    INTERRUPTION_ATTEMPTS,
    SAMPLE_ATTEMPTS,
    AcceptedGroup,
    Assignment,
    FailedTask,
    PromptTask,
    RetryReport,
    failure_reason,
    retry_id,
)

QUEUE_ID = "rollout"
DATASET_PRODUCER = "dataset"
TRAINING_CONSUMER = "training"
RETRY_CHUNK = 500  # failed tasks resubmitted per journal transaction

__all__ = ["StrawRolloutQueue", "StoreOptions", "open_store", "StaleLease", "IdempotencyConflict"]


class StaleLease(MemberDied, RuntimeError):
    """The lease is no longer current (expired, fenced by a restart, or already reassigned)."""


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Where and how a run's queue storage lives; every process opens its own handle from it."""

    data_dir: str
    run_id: str = "vime"
    segment_mib: float = 64.0  # packs are sealed (and become reclaimable) at about this size
    collect_online: bool = False  # the controller reclaims storage at every commit
    profile: str = "local"  # local | juicefs
    declaration: dict | None = None  # what straw requires to trust a JuiceFS mount

    def open(self, fault: Callable[[str], None] | None = None) -> SharedFilesystemStore:
        return open_store(
            self.data_dir,
            self.run_id,
            segment_mib=self.segment_mib,
            profile=self.profile,
            declaration=self.declaration,
            fault=fault,
        )


def open_store(
    data_dir: str,
    run_id: str,
    *,
    segment_mib: float = 64,
    profile: str = "local",
    declaration: dict | None = None,
    fault: Callable[[str], None] | None = None,
) -> SharedFilesystemStore:
    """One writer/reader handle; each process opens its own (a handle must not cross a fork).

    straw's storage catalog is always on (``online_gc=True``): without it nothing can ever be
    reclaimed, not even by ``vime queue gc`` after the run (measured cost: ~0.5 ms per publication).
    Whether the run itself collects is --rollout-queue-online-gc. ``fault``: straw's test hook, called with
    the name of each phase of its writes (the fault tests' kills and holds, vime/recovery/faults.py).
    """
    backend = FilesystemBackend(data_dir, profile=profile, declaration=declaration, fault=fault)
    return SharedFilesystemStore(
        data_dir,
        run_id,
        backend=backend,
        codecs=CODECS,
        segment_target_bytes=int(segment_mib * 1024**2),
        online_gc=True,
    )


@dataclasses.dataclass
class StrawRolloutQueue:
    """The queue. Attempts: straw counts every ended attempt against a task's ``max_attempts`` (a
    failed call, an expired lease, a lease revoked by a recovery); vime spends a prompt's attempts on
    failures of the sample only (``fail``), so tasks are submitted with straw's budget at
    INTERRUPTION_ATTEMPTS and the queue fails a task itself at its ``sample_attempts``-th failed call.
    The count of failed calls per task is rebuilt from the journal when the queue is recovered."""

    store: SharedFilesystemStore
    coordinator: Coordinator
    sample_attempts: int = SAMPLE_ATTEMPTS
    sample_failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def open(
        cls,
        options: StoreOptions,
        *,
        owner: str,
        lease_seconds: float,
        sample_attempts: int = SAMPLE_ATTEMPTS,
        fault: Callable[[str], None] | None = None,
    ) -> StrawRolloutQueue:
        """Open (or recover, when a journal exists) the queue. The caller must hold the fence. ``fault``: straw's
        hook at each phase of the store's and the journal's writes (fault tests; see StoreOptions.open)."""
        store = options.open(fault)
        recover = os.path.exists(os.path.join(options.data_dir, "control", "journal.log"))
        coordinator = Coordinator(
            store, queue_id=QUEUE_ID, exclusive_owner=owner, recover=recover, lease_seconds=lease_seconds
        )
        queue = cls(store, coordinator, sample_attempts)
        if recover:
            queue.sample_failures = failed_calls(options.data_dir)
        return queue

    def close(self) -> None:
        self.coordinator.close()
        self.store.close()

    # ----------------------------------------------------------------- prompts
    def submit(self, tasks: list[PromptTask], cursor: dict[str, Any]) -> None:
        """Submit prompts and move the dataset cursor in one journal transaction."""
        specs = [self._spec(t) for t in tasks]
        request = f"refill-{tasks[0].task_id}" if tasks else f"refill-empty-{cursor}"
        self.coordinator.submit_tasks(request, specs, producer_id=DATASET_PRODUCER, producer_state=cursor)

    def task(self, task_id: str) -> PromptTask:
        spec = self.coordinator.task_status(task_id)["spec"]
        return PromptTask.from_metadata(task_id, spec["metadata"])

    def has_task(self, task_id: str) -> bool:
        # A point lookup: the coordinator's ``tasks`` attribute serializes its whole state on every read
        # (milliseconds per thousand tasks), and the controller asks once per accepted group it looks at.
        return self.coordinator.task_status(task_id) is not None

    def regenerate(self, task: PromptTask, request_id: str) -> None:
        """Submit a prompt again without moving the dataset cursor (idempotent per request id)."""
        self.coordinator.submit_tasks(request_id, [self._spec(task)])

    def _spec(self, task: PromptTask) -> TaskSpec:
        return TaskSpec(
            task.task_id,
            metadata=task.metadata(),
            allow_empty=True,
            max_attempts=INTERRUPTION_ATTEMPTS,
            priority=task.priority,
            scheduling_key=task.min_version,
        )

    # ----------------------------------------------------------------- failed tasks
    def failed(self) -> list[FailedTask]:
        """Every task that ended failed and has not been retried, in submission order (the rejected
        ones too: ``FailedTask.rejected``). A failed task whose retry exists is not listed."""
        tasks = self.coordinator.tasks
        failed = [
            FailedTask(
                PromptTask.from_metadata(task_id, t["spec"]["metadata"]),
                self._attempts_spent(task_id, t),
                failure_reason(t.get("failure")),
            )
            for task_id, t in tasks.items()
            if t["state"] == "failed" and retry_id(task_id) not in tasks
        ]
        return sorted(failed, key=lambda f: (f.task.group_index, f.task.task_id))

    def _attempts_spent(self, task_id: str, task: dict) -> int:
        """Attempts a task spent: its failed calls, or straw's count for a task submitted before vime
        stopped counting interruptions (its journal's max_attempts is straw's default)."""
        if task["spec"].get("max_attempts", 0) >= INTERRUPTION_ATTEMPTS:
            return self.sample_failures.get(task_id, 0)
        return task.get("failures", 0)

    def retry_failed(self) -> RetryReport:
        """Submit every failed task again, except the rejected ones, as a fresh prompt with a new
        attempt budget, without moving the dataset cursor. Idempotent: a retried task is no longer
        listed by failed(), and a retry's task id and request id are deterministic, so a call
        replayed after a crash submits nothing twice. The retry produces its own accepted group
        (the failed task produced none), so the prompt is trained once."""
        failed = self.failed()
        todo = [(f.task.task_id, f.task.retried()) for f in failed if not f.rejected]
        for start in range(0, len(todo), RETRY_CHUNK):
            chunk = todo[start : start + RETRY_CHUNK]
            digest = hashlib.sha256(" ".join(new.task_id for _, new in chunk).encode()).hexdigest()[:24]
            self.coordinator.submit_tasks(f"retry-failed-{digest}", [self._spec(new) for _, new in chunk])
        return RetryReport(todo, rejected=sum(f.rejected for f in failed))

    def dataset_cursor(self) -> dict[str, Any] | None:
        return self.coordinator.producer_state(DATASET_PRODUCER)

    def pending(self) -> list[PromptTask]:
        return [PromptTask.from_metadata(t.task_id, t.metadata) for t in self.coordinator.pending_tasks()]

    # ----------------------------------------------------------------- leases
    def acquire(self, worker_id: str, max_tasks: int) -> list[Assignment]:
        result = self.coordinator.acquire(worker_id, max_tasks)
        return [
            Assignment(PromptTask.from_metadata(a.task.task_id, a.task.metadata), a.lease, a.task.input_ref)
            for a in result.assignments
        ]

    def heartbeat(self, leases: list) -> list[bool]:
        """True for each lease that is still current."""
        return [result == "extended" for result in self.coordinator.heartbeat(leases)]

    def complete(self, lease, submission_id: str, ref: RecordSetRef) -> int:
        """Accept a group; returns its position. Idempotent per submission id."""
        try:
            receipt = self.coordinator.complete_task(
                lease, submission_id=submission_id, result_ref=ref, result_digest=ref.digest
            )
        except (StaleAttempt, LeaseExpired) as error:
            raise StaleLease(str(error)) from None
        return receipt.position

    def return_partial(self, lease, task: PromptTask, partial: RecordSetRef | None, request_id: str) -> None:
        """Give a task back as a continuation (with its durable prefix) or untouched (no prefix)."""
        try:
            if partial is None:
                self.coordinator.release_tasks([lease], request_id=request_id)
            else:
                self.coordinator.yield_tasks(
                    [
                        {
                            "lease": lease,
                            "input_ref": partial,
                            "priority": task.priority,
                            "scheduling_key": task.min_version,
                            "metadata": task.metadata(),
                        }
                    ],
                    request_id=request_id,
                )
        except (StaleAttempt, LeaseExpired) as error:
            raise StaleLease(str(error)) from None

    def fail(self, lease, reason: str, request_id: str, retryable: bool = True) -> None:
        """A failure of the sample itself: it spends one of the task's attempts, and the last one (or a
        non-retryable failure) ends the task failed."""
        spent = self.sample_failures[lease.task_id] + 1
        final = not retryable or spent >= self.sample_attempts
        try:
            self.coordinator.fail_task(lease, request_id=request_id, failure=reason[:2000], retryable=not final)
        except (StaleAttempt, LeaseExpired) as error:
            raise StaleLease(str(error)) from None
        self.sample_failures[lease.task_id] = spent

    # ----------------------------------------------------------------- training consumer
    def accepted(self, cursor: int, limit: int) -> tuple[list[AcceptedGroup], int]:
        page = self.coordinator.read_commits(cursor, limit)
        groups = [AcceptedGroup(c.position, c.task_id, c.result_ref) for c in page.commits]
        return groups, page.cursor

    def open_consumer(self, owner: str) -> str:
        return self.coordinator.open_consumer(TRAINING_CONSUMER, exclusive_owner=owner)

    def consumer_cursor(self) -> int:
        state = self.coordinator.load_consumer_state(TRAINING_CONSUMER)
        return 0 if state is None else state["processed_cursor"]

    def commit_consumer(self, token: str, cursor: int, state_ref: RecordSetRef, request_id: str) -> None:
        """Durably mark every accepted group before ``cursor`` as trained."""
        self.coordinator.save_consumer_state(
            TRAINING_CONSUMER,
            token=token,
            request_id=request_id,
            state_ref=state_ref,
            fetch_cursor=cursor,
            processed_cursor=cursor,
        )

    def history_available(self, cursor: int) -> bool:
        """Whether the accepted groups from ``cursor`` on can still be read (GC keeps only what
        lies at or after the committed cursor)."""
        try:
            self.coordinator.read_commits(cursor, 1)
            return True
        except InvalidReference:
            return False

    def collect_garbage(self) -> dict[str, int]:
        """Reclaim sealed packs no owner references (trained groups, released orphans)."""
        return self.coordinator.collect_garbage()

    # ----------------------------------------------------------------- inspection
    def counts(self) -> dict[str, int]:
        return dict(self.coordinator.metrics().get("tasks", {}))


def failed_calls(data_dir: str) -> collections.Counter:
    """Failed calls (``fail_task``) per task id, replayed from the queue's journal."""
    counts: collections.Counter = collections.Counter()
    for event in JournalView.read(data_dir).of_type("Failed"):
        counts.update(event["task_ids"])
    return counts
