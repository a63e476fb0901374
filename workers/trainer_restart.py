"""Restoring the trainer in place while generation goes on (docs/queue-and-recovery.md, "The trainer
restarts in place").

When a trainer rank dies (its process killed, out of memory, its node lost) or a step fails inside the
trainer with an error that is not the user's to fix, the driver asks :class:`TrainerRestarter`, within
``--trainer-restart-budget``: the trainer group is started again (every rank: the survivors of a dead
rank would wait for it in their next collective) and loads the latest checkpoint this lineage saved, or
the checkpoint the run was resumed from, or nothing (the initial weights). The controller, the queue,
the router, the engines and the rollout workers are left alone. What the driver does with the
result (rewinding its consumer cursor, publishing the restored weights under a new version) is the
``serve`` callback the driver gives :meth:`TrainerRestarter.recover` (``vime/train.py``); which versions
are lost from then on is ``vime.recovery.lineage``. When the budget is spent, :class:`TrainerLost` stops
the run.

A user error raised by a step (a ``vime.errors.UserError``: a hook, a corrupt group) is not restarted: it
would fail again.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any, Protocol

from vime.errors import MemberDied, UserError
from vime.recovery import checkpoint as ckpt
from vime.workers.trainer_group import TrainerDied, TrainerGroup


class RestartCause(enum.Enum):
    DIED = "died"  # a rank's process is gone
    INTERNAL_ERROR = "failed"  # a step raised an error that is not the user's


class TrainerStepFailed(MemberDied, RuntimeError):
    """A training step raised, inside the trainer, an error that is not the user's to fix."""


class TrainerLost(UserError, RuntimeError):
    """The trainer died and cannot be restored in place (any more): the run stops, saying how to resume."""


class RunRecord(Protocol):
    """Where the restarts are said and recorded (vime.metrics.MetricsLog)."""

    def say(self, message: str) -> None: ...

    def write(self, record: dict[str, Any]) -> None: ...


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
    started from with --load, restored while this run has saved nothing of its own, as the run loaded it:
    without its optimizer state when ``resumed_optimizer`` is False (--no-load-optim)."""

    def __init__(
        self,
        trainer: TrainerGroup,
        *,
        budget: int,
        save_dir: str | None,
        resumed: tuple[str, ckpt.CheckpointState] | None,
        resumed_optimizer: bool = True,
    ):
        self.trainer, self.budget, self.save_dir, self.resumed = trainer, budget, save_dir, resumed
        self.resumed_optimizer = resumed_optimizer
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
            (folder, state), optimizer = ckpt.load_state(self.save_dir, saved_step), True
        elif self.resumed is not None:
            (folder, state), optimizer = self.resumed, self.resumed_optimizer
        else:
            return Restored(step=0, weight_version=0, consumer_cursor=0, step_cursors=[], skipped=[], folder=None)
        self.trainer.load_checkpoint(folder, optimizer=optimizer)
        return Restored(
            step=state.step,
            weight_version=state.weight_version,
            consumer_cursor=state.consumer_cursor,
            step_cursors=list(state.step_cursors),
            skipped=list(state.skipped),
            folder=folder,
        )

    def recover(
        self,
        error: Exception,
        step: int,
        *,
        saved_step: int | None,
        serve: Callable[[Restored], int],
        log: RunRecord,
    ) -> Restored:
        """The trainer died during ``step`` (or failed inside it, not by the user's fault): restore it in
        place and hand it to ``serve`` (which rewinds the driver to it and publishes its weights, returning
        the version they are served as), restarting again if it dies meanwhile; each restart is said and
        recorded. Raises the error that stops the run once the budget is spent."""
        cause = restart_cause(error)
        started = time.monotonic()
        while True:
            if self.spent:
                raise self._lost(error, step, cause)
            first_line = (str(error).strip().splitlines() or [""])[0]
            log.say(
                f"the trainer {cause.value} during step {step} ({first_line}); restarting it in place "
                f"({self.used + 1}/{self.budget} of --trainer-restart-budget) while generation goes on"
            )
            try:
                restored = self.restore(saved_step)
                version = serve(restored)
                break
            except TrainerDied as again:  # it died again while being restored: that is one more restart
                error, cause = again, RestartCause.DIED
        seconds = time.monotonic() - started
        log.write(
            {
                "kind": "trainer_restart",
                "step": step,
                "cause": cause.value,
                "error": str(error)[:2000],
                "restored_step": restored.step,
                "checkpoint": restored.folder,
                "weight_version": version,
                "lost_versions": [restored.weight_version + 1, version - 1],
                "seconds": round(seconds, 3),
                "restarts": self.used,
                "budget": self.budget,
            }
        )
        log.say(
            f"trainer restored in {seconds:.1f}s from "
            + (restored.folder or "the initial weights (no checkpoint yet)")
            + f": step {restored.step}, serving as weight version {version} (versions "
            f"{restored.weight_version + 1}..{version - 1} are lost; groups carrying them are generated again)"
        )
        return restored

    def _lost(self, error: Exception, step: int, cause: RestartCause | None) -> Exception:
        """The error that stops the run when the trainer cannot be restored (any more)."""
        if cause is RestartCause.INTERNAL_ERROR:
            return error.__cause__ or error  # an internal error: reported as before
        where = f"resume with --load {self.save_dir}" if self.save_dir else "run again"
        spent = (
            f" It was restarted in place {self.budget} time(s): --trainer-restart-budget {self.budget} is spent."
            if self.budget
            else ""
        )
        return TrainerLost(
            f"the trainer process died during step {step}; its state since the last checkpoint is "
            f"lost; {where} (no accepted sample is lost).{spent} Cause: {error}"
        )
