"""Prompt tasks: what a rollout worker leases, and the order in which they are handed out.

A task is one prompt of one epoch (one future group). It starts ``fresh``; a partial group
returned on a weight update, pause or shutdown makes it a ``continuation``. Scheduling order for
rollout workers: continuations before fresh prompts; within a stage the oldest weight version
first, then FIFO (straw orders by priority, then scheduling key, then submission order).
"""

from __future__ import annotations

import dataclasses
from typing import Any

FRESH_PRIORITY = 0
CONTINUATION_PRIORITY = 1
REJECTED_PREFIX = "rejected:"  # a failure with this reason is the dynamic filter's verdict: terminal
RETRY_MARK = ".retry"  # g000000042 -> g000000042.retry1 -> g000000042.retry2 ...
LEASE_EXPIRED = "lease expired (no heartbeat in time)"
LEASE_REVOKED = "lease revoked by a controller restart"
# A prompt's attempts are spent by failures of the sample itself only (its reward function raising,
# a malformed response, the user's custom generate raising): SAMPLE_ATTEMPTS of them fail the task.
# An interrupted attempt (a lease that expired because its worker died or hung, a lease revoked by a
# controller restart) is the infrastructure's fault and returns the prompt to the queue; straw's own
# attempt budget is set to INTERRUPTION_ATTEMPTS so that only a prompt that, say, kills its worker
# every time it is tried ever ends failed that way.
SAMPLE_ATTEMPTS = 3
INTERRUPTION_ATTEMPTS = 1000


@dataclasses.dataclass(frozen=True)
class PromptTask:
    task_id: str
    group_index: int  # running index of the group in the run (submission order)
    epoch: int
    prompt_index: int  # row of --prompt-data
    stage: str = "fresh"  # fresh | continuation
    min_version: int = 0  # oldest weight version among the partial tokens (continuations)

    @staticmethod
    def make(group_index: int, epoch: int, prompt_index: int) -> PromptTask:
        return PromptTask(f"g{group_index:09d}", group_index, epoch, prompt_index)

    def metadata(self) -> dict[str, Any]:
        return {
            "group_index": self.group_index,
            "epoch": self.epoch,
            "prompt_index": self.prompt_index,
            "stage": self.stage,
            "min_version": self.min_version,
        }

    @staticmethod
    def from_metadata(task_id: str, metadata: dict[str, Any]) -> PromptTask:
        return PromptTask(
            task_id,
            metadata["group_index"],
            metadata["epoch"],
            metadata["prompt_index"],
            metadata.get("stage", "fresh"),
            metadata.get("min_version", 0),
        )

    def regenerated(self, position: int) -> PromptTask:
        """The same prompt again, for the stale group accepted at ``position`` (a deterministic id
        makes the resubmission idempotent)."""
        return PromptTask(regenerated_id(position), self.group_index, self.epoch, self.prompt_index)

    def retried(self) -> PromptTask:
        """The same prompt again as a fresh task, for a task that ended failed (see
        :func:`retry_id`: a deterministic id makes retrying it a second time a no-op). A
        continuation's prefix is not carried over: the retry generates the group from scratch."""
        return PromptTask(retry_id(self.task_id), self.group_index, self.epoch, self.prompt_index)

    def as_continuation(self, min_version: int) -> PromptTask:
        return dataclasses.replace(self, stage="continuation", min_version=min_version)

    @property
    def priority(self) -> int:
        return CONTINUATION_PRIORITY if self.stage == "continuation" else FRESH_PRIORITY


def regenerated_id(position: int) -> str:
    """The id the prompt of the accepted group at ``position`` is submitted again under (deterministic:
    once submitted, in any lineage of the run, the group is never trained itself)."""
    return f"r{position:09d}"


def retry_id(task_id: str) -> str:
    """The id a failed task is retried under: one more than its own retry round."""
    root, _, round_ = task_id.partition(RETRY_MARK)
    return f"{root}{RETRY_MARK}{int(round_ or 0) + 1}"


def failure_reason(failure: Any) -> str:
    """straw's record of a task's last failure, as text: the reason given to fail_task, a lease
    expiry, or nothing when every failed attempt was a lease revoked by a controller restart."""
    if failure is None:
        return LEASE_REVOKED
    if isinstance(failure, dict):  # straw's own record of a lease that expired: {"reason": "Expired"}
        return LEASE_EXPIRED if failure.get("reason") == "Expired" else str(failure.get("reason", failure))
    return str(failure)


@dataclasses.dataclass(frozen=True)
class FailedTask:
    """A task that ended *failed*: its attempts were spent (``failures`` of them, the last for
    ``reason``), or the dynamic filter rejected it (``rejected``: terminal, never retried)."""

    task: PromptTask
    failures: int
    reason: str

    @property
    def rejected(self) -> bool:
        return self.reason.startswith(REJECTED_PREFIX)


@dataclasses.dataclass(frozen=True)
class RetryReport:
    """What ``retry_failed`` did: ``retried`` pairs each failed task's id with its retry (a fresh
    prompt with a new attempt budget), in the order the tasks were submitted; ``rejected`` tasks
    were left alone (terminal)."""

    retried: list[tuple[str, PromptTask]]
    rejected: int = 0


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A leased task as a rollout worker sees it. ``lease`` is opaque to the worker; ``partial`` is
    the transport reference of the durable prefix of a continuation (None for a fresh task)."""

    task: PromptTask
    lease: Any
    partial: Any = None


@dataclasses.dataclass(frozen=True)
class AcceptedGroup:
    """An accepted group in the order the trainer consumes it."""

    position: int  # acceptance order; the training consumer's cursor counts these
    task_id: str
    ref: Any  # transport reference of the group's records
