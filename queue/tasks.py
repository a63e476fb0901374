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


@dataclasses.dataclass(frozen=True)
class PromptTask:
    task_id: str
    group_index: int        # running index of the group in the run (submission order)
    epoch: int
    prompt_index: int       # row of --prompt-data
    stage: str = "fresh"    # fresh | continuation
    min_version: int = 0    # oldest weight version among the partial tokens (continuations)

    @staticmethod
    def make(group_index: int, epoch: int, prompt_index: int) -> "PromptTask":
        return PromptTask(f"g{group_index:09d}", group_index, epoch, prompt_index)

    def metadata(self) -> dict[str, Any]:
        return {"group_index": self.group_index, "epoch": self.epoch, "prompt_index": self.prompt_index,
                "stage": self.stage, "min_version": self.min_version}

    @staticmethod
    def from_metadata(task_id: str, metadata: dict[str, Any]) -> "PromptTask":
        return PromptTask(task_id, metadata["group_index"], metadata["epoch"], metadata["prompt_index"],
                          metadata.get("stage", "fresh"), metadata.get("min_version", 0))

    def regenerated(self, position: int) -> "PromptTask":
        """The same prompt again, for the stale group accepted at ``position`` (a deterministic id
        makes the resubmission idempotent)."""
        return PromptTask(f"r{position:09d}", self.group_index, self.epoch, self.prompt_index)

    def as_continuation(self, min_version: int) -> "PromptTask":
        return dataclasses.replace(self, stage="continuation", min_version=min_version)

    @property
    def priority(self) -> int:
        return CONTINUATION_PRIORITY if self.stage == "continuation" else FRESH_PRIORITY


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

    position: int           # acceptance order; the training consumer's cursor counts these
    task_id: str
    ref: Any                # transport reference of the group's records
