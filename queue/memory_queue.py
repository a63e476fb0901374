"""The same task queue in memory, for ``--rollout-data-transport object-store``.

Payloads then live in Ray's object store and nothing survives the controller: this transport is
for runs that do not need durability (and as the baseline the durable queue is measured against).
Semantics match ``StrawRolloutQueue``: leases with expiry, idempotent completion per submission
id, continuations before fresh prompts, oldest weight version first, then FIFO.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Any

from vime.errors import InternalError
from vime.queue.rollout_queue import StaleLease
from vime.queue.tasks import (
    INTERRUPTION_ATTEMPTS,
    LEASE_EXPIRED,
    SAMPLE_ATTEMPTS,
    AcceptedGroup,
    Assignment,
    FailedTask,
    PromptTask,
    RetryReport,
)


class IdempotencyConflict(InternalError, RuntimeError):
    """A submission id came back with other content than the first time: the queue contract forbids it
    (DESIGN.md section 3), so a caller is wrong."""


@dataclasses.dataclass(frozen=True)
class MemoryLease:
    task_id: str
    attempt_id: str
    worker_id: str


@dataclasses.dataclass
class _Entry:
    task: PromptTask
    partial: Any = None
    order: int = 0
    lease: MemoryLease | None = None
    expires: float = 0.0
    interruptions: int = 0  # expired leases: they spend no attempt (up to INTERRUPTION_ATTEMPTS)
    failures: int = 0
    state: str = "pending"
    reason: str = ""


class MemoryRolloutQueue:
    def __init__(self, *, lease_seconds: float, sample_attempts: int = SAMPLE_ATTEMPTS):
        self.lease_seconds, self.sample_attempts = lease_seconds, sample_attempts
        self._entries: dict[str, _Entry] = {}
        self._order = itertools.count()
        self._accepted: list[AcceptedGroup] = []
        self._receipts: dict[str, tuple[str, int, Any]] = {}
        self._cursor: dict[str, Any] | None = None
        self._consumer_cursor = 0

    def close(self) -> None:
        pass

    def submit(self, tasks: list[PromptTask], cursor: dict[str, Any]) -> None:
        for task in tasks:
            self._entries[task.task_id] = _Entry(task, order=next(self._order))
        self._cursor = dict(cursor)

    def task(self, task_id: str) -> PromptTask:
        return self._entries[task_id].task

    def has_task(self, task_id: str) -> bool:
        return task_id in self._entries

    def regenerate(self, task: PromptTask, request_id: str) -> None:
        if task.task_id not in self._entries:
            self._entries[task.task_id] = _Entry(task, order=next(self._order))

    def dataset_cursor(self) -> dict[str, Any] | None:
        return self._cursor

    def _expire(self) -> None:
        now = time.monotonic()
        for entry in self._entries.values():
            if entry.state == "leased" and entry.expires < now:
                # The worker died or hung: not the prompt's fault, so no attempt is spent.
                entry.interruptions += 1
                self._requeue(entry, LEASE_EXPIRED, failed=entry.interruptions >= INTERRUPTION_ATTEMPTS)

    def _retry(self, entry: _Entry, reason: str) -> None:
        entry.failures += 1
        self._requeue(entry, reason, failed=entry.failures >= self.sample_attempts)

    def _requeue(self, entry: _Entry, reason: str, *, failed: bool) -> None:
        entry.reason = reason
        entry.lease = None
        entry.state = "failed" if failed else "pending"
        entry.order = next(self._order)

    def pending(self) -> list[PromptTask]:
        self._expire()
        ready = [e for e in self._entries.values() if e.state == "pending"]
        ready.sort(key=lambda e: (-e.task.priority, e.task.min_version, e.order))
        return [e.task for e in ready]

    def acquire(self, worker_id: str, max_tasks: int) -> list[Assignment]:
        assignments = []
        for task in self.pending()[:max_tasks]:
            entry = self._entries[task.task_id]
            entry.lease = MemoryLease(task.task_id, uuid.uuid4().hex, worker_id)
            entry.state, entry.expires = "leased", time.monotonic() + self.lease_seconds
            assignments.append(Assignment(task, entry.lease, entry.partial))
        return assignments

    def _current(self, lease: MemoryLease) -> _Entry:
        self._expire()
        entry = self._entries.get(lease.task_id)
        if entry is None or entry.lease != lease or entry.state != "leased":
            raise StaleLease(f"lease of {lease.task_id} is not current")
        return entry

    def heartbeat(self, leases: list) -> list[bool]:
        results = []
        for lease in leases:
            try:
                self._current(lease).expires = time.monotonic() + self.lease_seconds
                results.append(True)
            except StaleLease:
                results.append(False)
        return results

    def complete(self, lease: MemoryLease, submission_id: str, ref: Any) -> int:
        if submission_id in self._receipts:
            attempt, position, first_ref = self._receipts[submission_id]
            if attempt != lease.attempt_id or first_ref is not ref:
                raise IdempotencyConflict(f"submission {submission_id} reused with different content")
            return position
        entry = self._current(lease)
        entry.state, entry.lease = "completed", None
        position = len(self._accepted)
        self._accepted.append(AcceptedGroup(position, lease.task_id, ref))
        self._receipts[submission_id] = (lease.attempt_id, position, ref)
        return position

    def return_partial(self, lease: MemoryLease, task: PromptTask, partial: Any, request_id: str) -> None:
        entry = self._current(lease)
        entry.task, entry.partial, entry.lease = task, partial, None
        entry.state, entry.order = "pending", next(self._order)

    def fail(self, lease: MemoryLease, reason: str, request_id: str, retryable: bool = True) -> None:
        entry = self._current(lease)
        if retryable:
            self._retry(entry, reason)
        else:
            entry.failures += 1
            entry.state, entry.lease, entry.reason = "failed", None, reason

    def failed(self) -> list[FailedTask]:
        self._expire()
        return [
            FailedTask(e.task, e.failures, e.reason)
            for e in self._entries.values()
            if e.state == "failed" and e.task.retried().task_id not in self._entries
        ]

    def retry_failed(self) -> RetryReport:
        failed = self.failed()
        todo = [(f.task.task_id, f.task.retried()) for f in failed if not f.rejected]
        for _, task in todo:
            self._entries[task.task_id] = _Entry(task, order=next(self._order))
        return RetryReport(todo, rejected=sum(f.rejected for f in failed))

    def accepted(self, cursor: int, limit: int) -> tuple[list[AcceptedGroup], int]:
        page = self._accepted[cursor : cursor + limit]
        return page, cursor + len(page)

    def open_consumer(self, owner: str) -> str:
        return owner

    def consumer_cursor(self) -> int:
        return self._consumer_cursor

    def commit_consumer(self, token: str, cursor: int, state_ref: Any, request_id: str) -> None:
        self._consumer_cursor = cursor
        # Trained groups are dropped so that the object store can free their payloads.
        for group in self._accepted[:cursor]:
            if group is not None:
                self._accepted[group.position] = AcceptedGroup(group.position, group.task_id, None)

    def history_available(self, cursor: int) -> bool:
        return all(g.ref is not None for g in self._accepted[cursor:])

    def collect_garbage(self) -> dict[str, int]:
        return {}

    def counts(self) -> dict[str, int]:
        self._expire()
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            counts[entry.state] = counts.get(entry.state, 0) + 1
        return counts
