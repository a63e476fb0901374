"""The three roots of vime's errors: who can act on a failure decides who catches it.

Every error class of vime derives from exactly one root, beside the builtin base it always had
(``class ConfigError(UserError, ValueError)``), so that ``except ValueError`` keeps working:

- :class:`UserError`: the user can act on it, and nothing inside vime can; the message names the flag,
  the file or the process to look at.
- :class:`MemberDied`: a member of a group of processes died or became unusable; the group that owns it
  restarts or replaces it, or gives its work to another member.
- :class:`InternalError`: an invariant of vime broke; a bug.

tests/unit/test_error_hierarchy.py fails for an error class of the package that has no root, or two.
This module imports nothing from vime, so that every layer (config and queue included) can use it.
"""

from __future__ import annotations

__all__ = ["InternalError", "MemberDied", "UserError"]


class UserError(Exception):
    """A failure the user can act on, and a retry or a restart cannot: a flag, a file, a hook, a busy port
    or queue, a server that refuses. Its message names the flag, the file or the process and what was
    expected.

    Who catches it: `vime train` (vime/train.py ``main``) prints it as one line, ``vime train: error:
    <message>``, and exits 1; a training step that fails with one (even wrapped by Ray) stops the run
    instead of restarting the trainer, where it would fail again. `vime engines` and `vime queue
    retry-failed` print theirs the same way."""


class MemberDied(Exception):
    """A member of a group of processes died or became unusable: a trainer rank, an engine, the router, a
    rollout worker whose lease the queue moved on from, a group whose payload could not be written.

    Who catches it: the group that owns the member (workers/trainer_restart.py restores the trainer in
    place, workers/engine_failures.py restarts or replaces engines, the rollout worker gives the group back
    to the queue, the controller drops a fenced worker's result), within its restart budget. When the
    budget is spent the group stops the run with a UserError naming what died (vime/train.py's
    ``RunError``)."""


class InternalError(Exception):
    """An invariant vime keeps broke (a submission reused with other content, a record that does not
    cover its sample, a delta that does not decode after its checksum matched): a bug to report with
    the traceback.

    Who catches it: nobody on purpose; it stops what raised it with its traceback. Code that must go on
    after one (a worker that fails one group rather than the run) does so by its own broad ``except``."""
