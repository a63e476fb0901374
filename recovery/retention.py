"""Checkpoint retention: --save-retain-last K and --save-retain-interval N (docs/queue-and-recovery.md).

What is never deleted:

- the latest complete checkpoint (``latest_checkpointed_iteration.txt``), nor anything at all when that file
  does not name a complete checkpoint: a checkpoint goes only once a newer complete one is recorded;
- the checkpoint the queue's committed consumer cursor belongs to (the newest one whose cursor is at or
  before it): online GC reclaims the groups before that cursor only, so it is the oldest checkpoint a
  resume can go back to; retention runs after the step's commit, when it is the latest one anyway, and
  this rule keeps it when a commit lags behind its checkpoint;
- checkpoints above the latest step: those of a lineage abandoned by ``--load --ckpt-step`` (the resumed
  lineage replaces them as it saves those steps again);
- anything while a checkpoint write holds the folder's lock (recovery/checkpoint.py): deletion then waits
  for the next save.

A checkpoint is deleted by renaming ``iter_NNNNNNN/`` to a hidden ``.iter_NNNNNNN.deleting-<id>/`` (one atomic
rename, made durable) and only then removing its files, oldest checkpoint first. A crash during the removal
leaves a hidden folder that neither ``--load`` nor ``--ckpt-step`` ever looks at (``--ckpt-step`` of that step
says it has no complete checkpoint and lists those that are there); the next pruning removes it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from vime.recovery import checkpoint as ckpt
from vime.recovery.faults import fault_point
from vime.runtime.durable import fsync_path

if TYPE_CHECKING:
    from vime.config.checkpoint import CheckpointConfig

DELETING = ".deleting-"


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None  # --save-retain-last
    retain_interval: int | None = None  # --save-retain-interval

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None or self.retain_interval is not None

    def kept(self, step: int, rank_from_latest: int) -> bool:
        """Whether the policy itself keeps ``step``, the ``rank_from_latest``-th newest (0: the latest)."""
        # Megatron-LM's --save-retain-interval alone keeps the last checkpoint besides the multiples.
        last = self.keep_last if self.keep_last is not None else 1
        return rank_from_latest < last or (self.retain_interval is not None and step % self.retain_interval == 0)


@dataclasses.dataclass(frozen=True)
class Pruning:
    deleted: list[int]  # steps, oldest first
    leftovers_removed: int  # hidden folders of deletions or writes a crash interrupted
    skipped: str = ""  # why nothing was deleted, when something would have been


def doomed_steps(
    cursors: dict[int, int], latest: int, policy: RetentionPolicy, committed_cursor: int | None
) -> list[int]:
    """The steps to delete, oldest first: ``cursors`` maps each complete checkpoint's step to its consumer
    cursor; ``committed_cursor`` is the queue's committed cursor (None: not known, nothing is protected for
    it)."""
    if not policy.enabled or latest not in cursors:
        return []
    candidates = sorted((step for step in cursors if step <= latest), reverse=True)
    protected = {latest}
    if committed_cursor is not None:
        resumable = [step for step in candidates if cursors[step] <= committed_cursor]
        if resumable:
            protected.add(resumable[0])
    doomed = [
        step
        for rank, step in enumerate(candidates)
        if step not in protected and not policy.kept(step, rank_from_latest=rank)
    ]
    return sorted(doomed)


def delete_checkpoint(root: str, step: int) -> None:
    """Hide ``iter_<step>/`` under its deleting name (atomic, durable), then remove its files."""
    hidden = os.path.join(root, f".{os.path.basename(ckpt.iteration_dir(root, step))}{DELETING}{uuid.uuid4().hex[:8]}")
    os.rename(ckpt.iteration_dir(root, step), hidden)
    fsync_path(root)
    _remove_tree(hidden)


def _remove_tree(path: str) -> None:
    for folder, subfolders, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(folder, name))
            fault_point("checkpoint.mid_delete")  # a crash with the folder half removed
        for name in subfolders:
            os.rmdir(os.path.join(folder, name))
    os.rmdir(path)


def _leftovers(root: str) -> list[str]:
    """Hidden folders a crash left: a deletion's (``.iter_*.deleting-*``) or a write's staging
    (``.iter_*.tmp-*``): with the lock held no write is in progress, so no staging folder is live."""
    return [
        os.path.join(root, name)
        for name in os.listdir(root)
        if name.startswith(".iter_") and (DELETING in name or ".tmp-" in name)
    ]


def prune_checkpoints(root: str, policy: RetentionPolicy, *, committed_cursor: int | None) -> Pruning:
    """Delete what ``policy`` does not keep in ``root`` (see the module's docstring for what it never deletes)."""
    if not policy.enabled or not os.path.isdir(root):
        return Pruning(deleted=[], leftovers_removed=0)
    with ckpt.checkpoint_lock(root, wait_s=0) as locked:
        if not locked:
            return Pruning(deleted=[], leftovers_removed=0, skipped=f"a checkpoint write holds {ckpt.LOCK}")
        leftovers = _leftovers(root)
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        latest = ckpt.latest_step(root)
        if latest is None:
            return Pruning(deleted=[], leftovers_removed=len(leftovers))
        cursors = {step: ckpt.read_state(root, step).consumer_cursor for step in ckpt.complete_steps(root)}
        doomed = doomed_steps(cursors, latest, policy, committed_cursor)
        for step in doomed:
            delete_checkpoint(root, step)
        return Pruning(deleted=doomed, leftovers_removed=len(leftovers))


def apply_retention(config: CheckpointConfig, *, committed_cursor: int, say: Callable[[str], None]) -> None:
    """The driver's pruning after each save: --save-retain-last / --save-retain-interval, once the step's
    checkpoint and its queue commit are durable. A deletion that fails is said; the run goes on (what is kept
    is only more than asked)."""
    policy = RetentionPolicy(keep_last=config.save_retain_last, retain_interval=config.save_retain_interval)
    if not policy.enabled:
        return
    try:
        pruning = prune_checkpoints(config.save, policy, committed_cursor=committed_cursor)
    except OSError as error:
        say(f"could not delete an old checkpoint in --save {config.save}: {error}; the run goes on")
        return
    if pruning.deleted:
        steps = ", ".join(map(str, pruning.deleted))
        say(f"deleted checkpoint step(s) {steps} in {config.save} (--save-retain-last/--save-retain-interval)")
    if pruning.skipped:
        say(f"old checkpoints kept for now: {pruning.skipped}")
