"""A volume that fills up, or whose file system goes away, while the run goes on (issue 23, point 3;
docs/queue-and-recovery.md "Disk space"; issue 18's storage faults, docs/juicefs.md).

Each durable write of the run (a straw publish or an acceptance commit on the queue, a checkpoint, a weight
version, a debug archive) is made so that a failure leaves nothing half-written visible: a checkpoint and a
weight version are written under a hidden staging name and renamed when complete, the queue's journal is
straw's. What this module adds is the recognition of a full volume among the errors such a write raises,
and the one error the run then stops with: which flag and directory, which operation, that what was
committed is intact, and how to resume.

A full volume shows as an ``OSError`` ENOSPC or EDQUOT, or straw's ``QuotaExceeded``, either wrapped by Ray
(whose wrapper of a remote error sometimes keeps only its text). On the queue, straw says it differently
once one of its journal appends failed for want of space: that append raises ``IndeterminateCommit``
("Journal write/sync outcome unknown"), and from then on the coordinator answers every call with
``UnsafeRecovery`` ("Coordinator unavailable; stop owner and recover"), a writer's gate or close with
``UnsafeRecovery`` / ``IndeterminateCommit`` too (all seen on a real tmpfs, tests/unit/test_disk_full.py).
Those errors also come from failures that have nothing to do with space (a second owner of the queue, a
torn journal), so they count as a full volume only when the queue's volume has less than
:attr:`WrittenVolume.headroom` free when they arrive; otherwise they keep their own message.

A volume whose file system went away answers ``ENOTCONN`` ("Transport endpoint is not connected", straw's
``StorageUnavailable: ... (os error 107)``): a FUSE mount, such as a JuiceFS client's, whose client process died.
The run then stops with :class:`VolumeLost`, naming the flag and directory and how to resume once the volume
is mounted again, instead of a traceback of whichever call found it first.

A volume that answers a call with ``EIO`` ("Input/output error", straw's ``StorageUnavailable: ... (os error 5)``)
failed that call: a JuiceFS client whose metadata server went away while a lock was waited for answers so (seen
with Redis killed and started again mid-run, tests/faults/test_juicefs_storage_faults.py). A rollout worker's
publication that fails so goes back to the queue and the worker goes on; anywhere else the run stops with
:class:`VolumeFailed`, naming the flag and directory and how to resume once the volume answers again. A journal
append or sync of the queue that fails so reaches the caller as straw's ``IndeterminateCommit`` without the
errno, and the calls after it as ``UnsafeRecovery``: on a queue volume that is not full, the first is such a failed
call too. The run's controller then ends its process and a new one recovers the queue (recovery/volume_failure.py);
where it does not (a controller made in-process), it names the failed write in the refusals after it
(workers/controller.py, ``QueueBroken``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vime.errors import UserError
from vime.recovery.disk_space import NEARLY_FULL_BYTES, free_bytes, readable_bytes

if TYPE_CHECKING:
    from vime.config import TrainSettings

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How a full volume reads once only the text of the error is left (a Ray wrapper, straw's Rust errors).
DISK_FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
# straw's errors (straw.errors) that a failed write on a full queue volume leaves behind, by name: a wrapper
# that kept only the text still names them ("straw.errors.UnsafeRecovery: ...", "... failed: IndeterminateCommit:").
STRAW_AFTER_A_FAILED_WRITE = ("IndeterminateCommit", "UnsafeRecovery", "StorageUnavailable")
MiB = 1 << 20
# A mounted file system whose server side is gone (a FUSE client process killed): errno and the texts it leaves.
LOST_ERRNOS = (errno.ENOTCONN,)
LOST_TEXTS = ("Transport endpoint is not connected", "os error 107")
# straw's answer when a journal append or sync of the queue did not complete ("Journal write/sync outcome unknown"),
# which keeps no errno: on a queue volume that is not full, a call the volume failed.
WRITE_OUTCOME_UNKNOWN = "IndeterminateCommit"
# A call the volume's file system could not complete (EIO): errno and the texts it leaves.
FAILED_ERRNOS = (errno.EIO,)
FAILED_TEXTS = ("Input/output error", "os error 5)")


class DiskFull(UserError, RuntimeError):
    """A write of the run failed because its volume is full: the run stops, saying where and how to resume.
    A one-argument exception: Ray and pickle rebuild it from its message."""


class VolumeLost(UserError, RuntimeError):
    """A write or read of the run failed because its volume's file system went away (a FUSE client killed): the
    run stops, saying where and how to resume. A one-argument exception, as :class:`DiskFull`."""


class VolumeFailed(UserError, RuntimeError):
    """A write or read of the run failed with an I/O error of its volume (EIO): the run stops, saying where and how
    to resume. A one-argument exception, as :class:`DiskFull`."""


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and what it wraps: a Ray task error keeps the remote exception in ``cause``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        ray_cause = getattr(error, "cause", None)
        error = ray_cause if isinstance(ray_cause, BaseException) else (error.__cause__ or error.__context__)


def disk_full_cause(error: BaseException | None) -> str | None:
    """The full volume's own error text, when ``error`` (or what it wraps) is one; None otherwise (and for a
    :class:`DiskFull`, which already said it with its directory: not to be wrapped again)."""
    for link in _chain(error):
        if isinstance(link, DiskFull):
            return None
        if isinstance(link, OSError) and link.errno in DISK_FULL_ERRNOS:
            return os.strerror(link.errno)
        if type(link).__name__ == "QuotaExceeded" or any(text in str(link) for text in DISK_FULL_TEXTS):
            return next((text for text in DISK_FULL_TEXTS if text in str(link)), str(link).splitlines()[0])
    return None


def _volume_errno_cause(error: BaseException | None, errnos: tuple[int, ...], texts: tuple[str, ...]) -> str | None:
    """The text of the first error in ``error``'s chain whose errno is one of ``errnos`` (or whose text, all a
    wrapper kept, holds one of ``texts``: then ``texts[0]``); None for none, or where a stop that already said
    its volume comes first (:class:`DiskFull`, :class:`VolumeLost`, :class:`VolumeFailed`: not wrapped again)."""
    for link in _chain(error):
        if isinstance(link, VolumeLost | DiskFull | VolumeFailed):
            return None
        if isinstance(link, OSError) and link.errno in errnos:
            return os.strerror(link.errno)
        if any(text in str(link) for text in texts):
            return texts[0]
    return None


def volume_lost_cause(error: BaseException | None) -> str | None:
    """The lost file system's error text, when ``error`` (or what it wraps) says its volume is not connected any
    more; None otherwise (and for a stop already said)."""
    return _volume_errno_cause(error, LOST_ERRNOS, LOST_TEXTS)


def straw_failure_after_a_write(
    error: BaseException | None, names: tuple[str, ...] = STRAW_AFTER_A_FAILED_WRITE
) -> str | None:
    """``"<straw error>: <its message>"`` when ``error`` (or what it wraps) is one of the straw errors ``names`` (by
    default those a failed write leaves behind, :data:`STRAW_AFTER_A_FAILED_WRITE`), as an object or in the text a
    wrapper kept (Ray's, or the controller's ``QueueBroken``, which names the failed write a refusal followed);
    None otherwise."""
    named_in_text = re.compile(rf"\b({'|'.join(names)}): ([^\n]*)")
    for link in _chain(error):
        if isinstance(link, DiskFull):
            return None
        if type(link).__module__.startswith("straw") and type(link).__name__ in names:
            return f"{type(link).__name__}: {str(link).splitlines()[0] if str(link) else ''}"
        named = named_in_text.search(str(link))
        if named:
            return f"{named.group(1)}: {named.group(2).strip()}"
    return None


def _said_by_straw(error: BaseException, name: str) -> bool:
    """Whether straw's error ``name`` is ``error`` or what it wraps, as an object or in the text a wrapper kept."""
    return any(type(link).__name__ == name or f"{name}: " in str(link) for link in _chain(error))


def resume_hint(save: str | None) -> str:
    if save:
        return f"resume with --load {save} (nothing accepted is lost, nothing is trained twice)"
    return "start the run again (without --save there is no checkpoint to resume from)"


def volume_failed_cause(error: BaseException | None) -> str | None:
    """The I/O error's text, when ``error`` (or what it wraps) is a call its volume could not complete (EIO); None
    otherwise (and for a stop already said)."""
    return _volume_errno_cause(error, FAILED_ERRNOS, FAILED_TEXTS)


@dataclasses.dataclass(frozen=True)
class WrittenVolume:
    """A directory the run writes, with the flag that names it, and what a stop there says about resuming."""

    flag: str
    path: str
    save: str | None  # --save: where a resume loads from
    # Only for the queue (straw's directory): below this many bytes free, straw's errors after a failed write
    # (STRAW_AFTER_A_FAILED_WRITE) mean a full volume. None: not straw's.
    headroom: int | None = None

    @classmethod
    def queue(cls, data_dir: str, segment_mib: float, save: str | None) -> WrittenVolume:
        # The write that failed may have been as large as a pack (--rollout-queue-segment-mib), and straw removes
        # its partial bytes again: a volume with less than that free could not take it.
        return cls("--rollout-data-dir", data_dir, save, headroom=max(NEARLY_FULL_BYTES, int(segment_mib * MiB)))

    def full_cause(self, error: BaseException) -> str | None:
        """Why ``error`` means that this volume is full (the text the stop says), or None."""
        cause = disk_full_cause(error)
        if self.headroom is None or (cause is not None and _said_by_straw(error, "QuotaExceeded")):
            return cause  # straw writes nowhere else than the queue: its QuotaExceeded (ENOSPC, EDQUOT) is this one's
        # Anything else counts only while the queue's volume has no room: the driver's stop around its whole loop
        # must not blame the queue for another volume's ENOSPC, nor for an UnsafeRecovery of another cause.
        said = cause or straw_failure_after_a_write(error)
        if said is None:
            return None
        try:
            free = free_bytes(self.path)
        except OSError:
            return None  # no answer from the volume: not known to be full, the error keeps its own message
        return f"{said}; {readable_bytes(free)} free there" if free < self.headroom else None

    def full(self, operation: str, cause: str) -> DiskFull:
        return DiskFull(
            f"the volume of {self.flag} {self.path} is full: {operation} failed ({cause}). What the run committed "
            f"before is intact; free space there (or move {self.flag} to a bigger volume), then "
            f"{resume_hint(self.save)}"
        )

    def full_error(self, operation: str, error: BaseException) -> DiskFull | None:
        """The stop to raise instead of ``error``, when ``error`` means that this volume is full."""
        cause = self.full_cause(error)
        return None if cause is None else self.full(operation, cause)

    def lost_error(self, operation: str, error: BaseException) -> VolumeLost | None:
        """The stop to raise instead of ``error``, when ``error`` means that this volume's file system is gone."""
        cause = volume_lost_cause(error)
        if cause is None:
            return None
        return VolumeLost(
            f"the volume of {self.flag} {self.path} is not reachable any more: {operation} failed ({cause}: its "
            f"file system's client, e.g. a JuiceFS mount's process, is gone). What the run committed before is "
            f"intact; mount the volume again at the same path (`juicefs umount` the dead mount first), then "
            f"{resume_hint(self.save)}"
        )

    def failed_error(self, operation: str, error: BaseException) -> VolumeFailed | None:
        """The stop to raise instead of ``error``, when ``error`` is an I/O error of this volume. On the queue's
        (whose stop the driver keeps around its whole loop) only straw's, or one on a file in its directory: an
        engine's or the trainer's EIO elsewhere keeps its own message."""
        cause = volume_failed_cause(error)
        if cause is None and self.headroom is not None:
            # straw keeps no errno of a journal append or sync that failed: its answer is the cause (the queue's
            # volume is not full, or full_error would have said so first).
            cause = straw_failure_after_a_write(error, (WRITE_OUTCOME_UNKNOWN,))
        if cause is None or (self.headroom is not None and not self._names_this_volume(error)):
            return None
        return VolumeFailed(
            f"the volume of {self.flag} {self.path} failed a call: {operation} failed ({cause}: its file system "
            f"could not complete it, e.g. a JuiceFS mount whose metadata server went away for a while). What the "
            f"run committed before is intact; once the volume answers again (`ls {self.path}` works), "
            f"{resume_hint(self.save)}"
        )

    def _names_this_volume(self, error: BaseException) -> bool:
        """Whether ``error`` is straw's (straw writes only the queue's directory) or an OSError on a path in it, as
        an object or in the text a wrapper kept (Ray's, of an actor that could not start: "OSError: [Errno 5]
        Input/output error: '<dir>/controller.volume-probe'", recovery/volume_failure.py)."""
        if straw_failure_after_a_write(error) is not None:
            return True
        roots = {os.path.join(os.path.realpath(self.path), ""), os.path.join(os.path.abspath(self.path), "")}
        for link in _chain(error):
            if isinstance(link, OSError) and link.filename:
                if os.path.realpath(str(link.filename)).startswith(tuple(roots)):
                    return True
            elif any(f"'{root}" in str(link) for root in roots):
                return True
        return False

    @contextlib.contextmanager
    def stop_when_full(self, operation: str) -> Iterator[None]:
        """Turn a full volume during ``operation`` into :class:`DiskFull`, a volume whose file system went away
        into :class:`VolumeLost`, and an I/O error of the volume into :class:`VolumeFailed`; any other error
        passes unchanged."""
        try:
            yield
        except Exception as error:
            stop = (
                self.full_error(operation, error)
                or self.lost_error(operation, error)
                or self.failed_error(operation, error)
            )
            if stop is None:
                raise
            raise stop from error


@dataclasses.dataclass(frozen=True)
class RunVolumes:
    """The volumes a ``vime train`` run writes while it goes on, each said by its own flag when it fills."""

    queue: WrittenVolume
    checkpoint: WrittenVolume
    weights: WrittenVolume
    debug_archive: WrittenVolume

    @classmethod
    def from_settings(cls, s: TrainSettings) -> RunVolumes:
        save = s.checkpoint.save
        return cls(
            queue=WrittenVolume.queue(s.rollout_data_dir, s.queue.rollout_queue_segment_mib, save),
            checkpoint=WrittenVolume("--save", save or "", save),
            weights=WrittenVolume("--update-weight-disk-dir", s.weight_dir, save),
            debug_archive=WrittenVolume("--save-debug-rollout-data", s.debug.save_debug_rollout_data or "", save),
        )
