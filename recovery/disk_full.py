"""A volume that fills up while the run goes on (issue 23, point 3; docs/queue-and-recovery.md "Disk space").

Each durable write of the run (a straw publish or an acceptance commit on the queue, a checkpoint, a weight
version, a debug archive) is made so that a failure leaves nothing half-written visible: a checkpoint and a
weight version are written under a hidden staging name and renamed when complete, the queue's journal is
straw's. What this module adds is the recognition of a full volume among the errors such a write raises
(an ``OSError`` ENOSPC or EDQUOT, straw's ``QuotaExceeded``, either wrapped by Ray, whose wrapper of a remote
error sometimes keeps only its text), and the one error the run then stops with: which flag and directory,
which operation, that what was committed is intact, and how to resume.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from vime.errors import UserError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a full volume reads once only the text of the error is left (a Ray wrapper, straw's Rust errors).
DISK_FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class DiskFull(UserError, RuntimeError):
    """A write of the run failed because its volume is full: the run stops, saying where and how to resume.
    Built by :func:`disk_full` (a one-argument exception: Ray and pickle rebuild it from its message)."""


def disk_full(operation: str, flag: str, path: str, cause: str, resume: str) -> DiskFull:
    return DiskFull(
        f"the volume of {flag} {path} is full: {operation} failed ({cause}). What the run committed before is "
        f"intact; free space there (or move {flag} to a bigger volume), then {resume}"
    )


def disk_full_cause(error: BaseException | None) -> str | None:
    """The full volume's own error text, when ``error`` (or what it wraps) is one; None otherwise."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFull):
            return None  # already said, with its directory: not to be wrapped again
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return os.strerror(error.errno)
        if type(error).__name__ == "QuotaExceeded" or any(text in str(error) for text in DISK_FULL_TEXTS):
            return next((text for text in DISK_FULL_TEXTS if text in str(error)), str(error).splitlines()[0])
        ray_cause = getattr(error, "cause", None)  # a Ray task error keeps the remote exception here
        error = ray_cause if isinstance(ray_cause, BaseException) else (error.__cause__ or error.__context__)
    return None


def resume_hint(save: str | None) -> str:
    if save:
        return f"resume with --load {save} (nothing accepted is lost, nothing is trained twice)"
    return "start the run again (without --save there is no checkpoint to resume from)"


@contextlib.contextmanager
def stop_when_full(operation: str, flag: str, path: str, save: str | None) -> Iterator[None]:
    """Turn a full volume during ``operation`` into :class:`DiskFull`; any other error passes unchanged."""
    try:
        yield
    except Exception as error:
        cause = disk_full_cause(error)
        if cause is None:
            raise
        raise disk_full(operation, flag, path, cause, resume_hint(save)) from error
