"""A write of the queue that its volume failed (EIO: a JuiceFS client whose metadata server went away for a while)
is ridden out by a new owner of the queue instead of stopping the run (issue 18, point 5; docs/juicefs.md).

straw's answer to a journal append or sync whose outcome it cannot know is to refuse every later call of that owner
("Coordinator unavailable; stop owner and recover"). A new owner recovers the journal as after a crash of the
controller, which Ray restarts already (workers/run_processes.py: every lease of the dead incarnation fenced, the
calls in flight retried against the new one). So the controller ends its own process on such a failure
(:func:`end_this_process`), and its next incarnation first waits for the volume to take a write again
(:func:`wait_until_writable`, up to :data:`VOLUME_WAIT_SECONDS`) before it recovers the queue.

Only a volume that *failed a call* is ridden out so: a full volume and one whose file system is gone still stop the
run with their own message (recovery/disk_full.py), since no restart helps before the user frees space or mounts
the volume again; nor does a volume still failing after the wait, or one whose last few incarnations met the same
failure (:func:`volume_restarts_refusal`). The new incarnation then comes up without taking the queue and answers
every call with the volume's error, which the driver reports as the volume's failure, naming the flag. It does not
raise it from its constructor: Ray would print that error, traceback and all, once for every call in flight.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

from vime.recovery.disk_full import WrittenVolume, volume_lost_cause

# How long a new controller waits for the queue's volume to take a write again before it gives up (the run stops).
# A metadata server restarted, a network blip: seconds to a minute or two.
VOLUME_WAIT_SECONDS = 300.0
RETRY_SECONDS = 2.0
# The file the wait writes, syncs and removes in the queue's directory (one name: a probe cut short by a kill
# leaves at most this file, which the next probe overwrites).
PROBE_NAME = "controller.volume-probe"
# The exit status of a controller that ended itself so that a new owner recovers the queue (Ray restarts it).
RESTART_EXIT_STATUS = 75  # EX_TEMPFAIL
# Incarnations in a row that ended so, without a step committed between them, after which the next one stops the run
# instead: a volume that takes the probe's write but keeps failing the queue's own (a JuiceFS lock that was being
# waited for when the metadata server died fails with EIO again and again) would otherwise spend Ray's restarts one
# by one and end with "the controller died", not naming the volume. Counted in RESTARTS_NAME in the queue's directory
# (a write the probe just showed the volume takes), removed by the next committed step and by a new run's driver.
MAX_VOLUME_RESTARTS = 3
RESTARTS_NAME = "controller.volume-restarts"


def ridden_out_cause(volume: WrittenVolume, error: BaseException) -> str | None:
    """Why ``error`` (a failed write of the queue on ``volume``) is one a new owner can ride out: the volume failed
    the call (EIO, or straw's unknown journal outcome on a volume with room). None where the run must stop instead:
    the volume is full or its file system is gone, or the error is not the volume's."""
    if volume.full_cause(error) is not None or volume.lost_error("", error) is not None:
        return None
    if volume.failed_error("", error) is None:
        return None
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def end_this_process() -> None:
    """End the controller's process at once, without running any cleanup that could write to the queue again
    (straw refuses the failed owner's every call; its fence, a flock, is released by the kernel). Ray counts it as
    a crash and restarts the actor."""
    os._exit(RESTART_EXIT_STATUS)


def probe(data_dir: str) -> None:
    """Write, sync and remove a small file in ``data_dir``: what a journal append needs of the volume."""
    path = os.path.join(data_dir, PROBE_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"vime: the controller checks that the queue's volume takes a write\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def wait_until_writable(
    data_dir: str,
    *,
    wait_seconds: float = VOLUME_WAIT_SECONDS,
    retry_seconds: float = RETRY_SECONDS,
    say: Callable[[str], None] = print,
) -> None:
    """Return once ``data_dir`` takes a synced write; raise the volume's last error if it has not within
    ``wait_seconds`` (each failed try said), and at once where its file system is gone (a mount whose client died
    answers ENOTCONN until it is mounted again, which no wait does). A directory that does not exist yet is not
    waited for (a new queue: the caller creates it)."""
    try:
        os.stat(data_dir)
    except FileNotFoundError:
        return
    except OSError:
        pass  # the volume fails: waited for below
    deadline = time.monotonic() + wait_seconds
    tries = 0
    while True:
        tries += 1
        try:
            probe(data_dir)
            if tries > 1:
                say(f"the queue's volume {data_dir} takes writes again (after {tries - 1} failed tries)")
            return
        except OSError as error:
            if volume_lost_cause(error) is not None:  # its client is gone: no wait brings a dead mount back
                say(f"the queue's volume {data_dir} is not reachable any more: {error}")
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"the queue's volume {data_dir} still fails after {wait_seconds:.0f}s: {error}")
                raise
            say(f"the queue's volume {data_dir} does not take a write ({error}); trying again for {left:.0f}s more")
        time.sleep(retry_seconds)


def volume_restarts(data_dir: str) -> int:
    """How many incarnations in a row ended on a failed write of the queue (0: none, or unreadable)."""
    try:
        with open(os.path.join(data_dir, RESTARTS_NAME)) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def count_volume_restart(data_dir: str) -> None:
    """One more incarnation ended on a failed write (best effort: a volume failing this write too keeps Ray's own
    restart limit as the bound)."""
    restarts = volume_restarts(data_dir) + 1  # (read before the file is opened for writing, which empties it)
    try:
        with open(os.path.join(data_dir, RESTARTS_NAME), "w") as f:
            f.write(f"{restarts}\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass


def forget_volume_restarts(data_dir: str) -> None:
    """A step was committed: the queue's writes go through again, and the count starts over."""
    try:
        os.unlink(os.path.join(data_dir, RESTARTS_NAME))
    except FileNotFoundError:
        pass


def volume_restarts_refusal(data_dir: str) -> OSError | None:
    """The volume's error (EIO, naming the count's file in the queue's directory: the driver stops the run naming
    --rollout-data-dir) when :data:`MAX_VOLUME_RESTARTS` incarnations in a row ended on a failed write; else None."""
    restarts = volume_restarts(data_dir)
    if restarts < MAX_VOLUME_RESTARTS:
        return None
    return OSError(
        errno.EIO,
        f"Input/output error: the queue's writes failed again after {restarts} restarts of its controller "
        "(the volume takes a new file's write, not the queue's)",
        os.path.join(data_dir, RESTARTS_NAME),
    )
