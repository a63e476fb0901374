"""Restoring the trainer in place while generation goes on (docs/queue-and-recovery.md, "The trainer
restarts in place").

When a trainer rank dies (its process killed, out of memory, its node lost) or a step fails inside the
trainer with an error that is not the user's to fix, the driver asks :class:`TrainerRestarter`, within
``--trainer-restart-budget``: the trainer group is started again (every rank: the survivors of a dead
rank would wait for it in their next collective) and loads the latest checkpoint this lineage saved, or
the checkpoint the run was resumed from, or nothing (the initial weights). The controller, the queue,
the router, the engines and the rollout workers are left alone. What the driver does with the
result (rewinding its consumer cursor, publishing the restored weights under a new version) is in
``vime/train.py``; which versions are lost from then on is ``vime.recovery.lineage``.

A user error raised by a step (a ``vime.errors.UserError``: a hook, a corrupt group) is not restarted: it
would fail again.
"""

from __future__ import annotations

import dataclasses
import enum

from vime.errors import MemberDied
from vime.recovery import checkpoint as ckpt
from vime.workers.trainer_group import TrainerDied, TrainerGroup


class RestartCause(enum.Enum):
    DIED = "died"  # a rank's process is gone
    INTERNAL_ERROR = "failed"  # a step raised an error that is not the user's


class TrainerStepFailed(MemberDied, RuntimeError):
    """A training step raised, inside the trainer, an error that is not the user's to fix."""


def restart_cause(error: BaseException) -> RestartCause | None:
    """Why ``error`` may be healed by restarting the trainer; None: it may not (stop the run)."""
    if isinstance(error, TrainerDied):
        return RestartCause.DIED
    if isinstance(error, TrainerStepFailed):
        return RestartCause.INTERNAL_ERROR
    return None


@dataclasses.dataclass(frozen=True)
class Restored:
    """What the restarted trainer holds: the state of the lineage at ``step``."""

    step: int  # steps trained into the weights it holds (0: the initial weights)
    weight_version: int  # the version those weights were published under (0: --hf-checkpoint)
    consumer_cursor: int  # the cursor, step cursors and skipped positions of that step
    step_cursors: list[int]
    skipped: list[int]
    folder: str | None  # the checkpoint loaded; None: the initial weights


class TrainerRestarter:
    """Restarts ``trainer`` at most ``budget`` times in a run. ``resumed``: the (folder, state) the run was
    started from with --load, restored while this run has saved nothing of its own."""

    def __init__(
        self,
        trainer: TrainerGroup,
        *,
        budget: int,
        save_dir: str | None,
        resumed: tuple[str, ckpt.CheckpointState] | None,
    ):
        self.trainer, self.budget, self.save_dir, self.resumed = trainer, budget, save_dir, resumed
        self.used = 0

    @property
    def spent(self) -> bool:
        return self.used >= self.budget

    def restore(self, saved_step: int | None) -> Restored:
        """Start the trainer again and load the lineage's latest checkpoint: ``saved_step`` (what this run
        saved last in --save; --save may hold later steps of an older lineage when the run was resumed
        from an earlier --ckpt-step), else the resumed one, else none. Counts against the budget."""
        self.used += 1
        self.trainer.restart()
        if saved_step is not None:
            folder, state = ckpt.load_state(self.save_dir, saved_step)
        elif self.resumed is not None:
            folder, state = self.resumed
        else:
            return Restored(step=0, weight_version=0, consumer_cursor=0, step_cursors=[], skipped=[], folder=None)
        self.trainer.load_checkpoint(folder)
        return Restored(
            step=state.step,
            weight_version=state.weight_version,
            consumer_cursor=state.consumer_cursor,
            step_cursors=list(state.step_cursors),
            skipped=list(state.skipped),
            folder=folder,
        )
