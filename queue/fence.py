"""The controller's fence: at most one controller drives a queue at any moment.

straw's Coordinator trusts its caller to be the only owner of the journal. vime enforces that
with an exclusive, non-blocking ``flock`` on a file in the queue directory, held for the
controller's lifetime; the kernel releases it when the process dies, so a restarted controller
can take over a crashed one's queue, but a second live run on the same queue is refused.

A lock can outlive its holder where the file system keeps locks for its clients' sessions: on JuiceFS, a
flock taken through a client that died before its holder (a lost host, a killed mount) stays with that client's
session until JuiceFS expires the session (measured here: free 65 s after the volume was mounted again; JuiceFS
judges a session stale after about five missed heartbeats, a minute by default; docs/juicefs.md). A holder known
to be dead is therefore waited out for up to :data:`STALE_HOLDER_WAIT_S`, saying so; a live holder is refused at
once. Known dead: the record names this host and a process that is gone (pid and start time, as the reaper's do,
``vime.runtime.reaper.owner_alive``, so a reused pid is not taken for the holder), or, for a holder on another
host (whose processes this host cannot see, e.g. a driver's host that was lost), its record has not been
refreshed for :data:`SILENT_AFTER_S`: the holder rewrites its record's ``alive_at`` every :data:`HEARTBEAT_S`
(synced, so that other clients of the volume read it). Hosts' clocks are taken to agree within a few seconds.

A holder can also be taken for gone while it lives on: a host frozen or cut off long enough for JuiceFS to expire
its client's session (the lock goes with the session) comes back, and its client and processes carry on
(measured here: JuiceFS says "Session 2 was stale and cleaned up, but now it comes back again", and the old holder
rewrote its record over the new holder's). So the holder checks, before it refreshes its record, that the record
still names it; once it names another holder the fence is :attr:`QueueFence.taken_by` that one, nothing is written
to the record again, and :meth:`QueueFence.ensure_held` (which the controller calls before each call on the queue)
raises :class:`QueueTaken`. A holder whose last confirmation is older than :data:`CONFIRM_AFTER_S` (frozen, or its
refreshes failing) confirms again before such a call; another holder could only have taken the fence after
:data:`SILENT_AFTER_S` of silence, so a call made within :data:`CONFIRM_AFTER_S` of a confirmation is safe, except
one that a frozen host then holds in the file system past the takeover: file systems offer no fencing token to
refuse that write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable

from vime.errors import UserError
from vime.runtime.reaper import owner_alive, process_start_time

STALE_HOLDER_WAIT_S = 180.0
RETRY_S = 2.0
HEARTBEAT_S = 10.0  # how often the holder refreshes its record's alive_at
SILENT_AFTER_S = 60.0  # a holder on another host whose record is older than this is taken as gone
# A holder that has not confirmed it still holds the fence for this long confirms before a call on the queue: well
# below SILENT_AFTER_S, with room for hosts' clocks that differ by seconds.
CONFIRM_AFTER_S = 2 * HEARTBEAT_S
UNREADABLE_RECORD_S = 1.0  # a record no read finds whole for this long was written by someone else


class QueueBusy(UserError, RuntimeError):
    """Another live controller holds the queue (or a dead one's lock did not come free in time)."""


class QueueTaken(UserError, RuntimeError):
    """Another controller took the queue while this one was taken for gone (its host frozen or cut off): this one
    must not write to it again. One argument, as Ray rebuilds it."""


def holder_identity(record: dict) -> tuple:
    """What tells one holding of the fence from another: the process, and when it took the fence."""
    return (record.get("host"), record.get("pid"), record.get("pid_start"), record.get("since"))


def record_text(raw: bytes) -> str:
    """A fence record as read from its file. A JuiceFS client can read a record rewritten shorter over a longer one
    at the longer one's size for a moment, its tail zeros (measured): those are not part of the record."""
    return raw.decode(errors="replace").strip("\x00 \n")


def now_boottime() -> float:
    """Seconds on a clock that also counts a suspended host's time (time.monotonic does not)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def holder_is_dead(holder: str, *, silent_after_s: float = SILENT_AFTER_S) -> bool:
    """Whether the holder record (``{"host", "pid", "pid_start", "alive_at", ...}``) names a process of this host
    that is gone (no such process, a zombie, or its pid now another process's), or a holder on another host whose
    ``alive_at`` is more than ``silent_after_s`` old. An unreadable record, or one without ``pid_start`` (written
    before it was recorded), names no process for sure: the holder is taken as alive; so is one on another host
    whose record has no ``alive_at`` (written before holders refreshed it)."""
    try:
        record = json.loads(holder)
        host, pid, pid_start = record["host"], int(record["pid"]), float(record["pid_start"])
    except (ValueError, KeyError, TypeError):
        return False
    if host == socket.gethostname():
        return not owner_alive(pid, pid_start)
    try:
        return time.time() - float(record["alive_at"]) > silent_after_s
    except (KeyError, TypeError, ValueError):
        return False


def silence(holder: str) -> str:
    """How long ago the holder refreshed its record, for the messages ("" where it says nothing of it)."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return f", silent for {time.time() - float(json.loads(holder)['alive_at']):.0f}s"
    return ""


class QueueFence:
    def __init__(self, fd: int, path: str, heartbeat_s: float, confirm_after_s: float):
        self._fd, self.path = fd, path
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start_time(os.getpid())}
        self._record["since"] = time.time()
        self._stop = threading.Event()
        self._confirm_after_s = confirm_after_s
        self._beating = threading.Lock()  # the refresh thread's beats and ensure_held's
        self.taken_by: str | None = None  # the record of the holder that took the fence from this one
        self._write_record()
        self._confirmed_at = now_boottime()
        # Its own thread: a holder busy in a long call still refreshes its record (a daemon: the process's end
        # ends it, as the kernel ends the lock).
        self._heartbeat = threading.Thread(
            target=self._refresh, args=(heartbeat_s,), name="vime-queue-fence", daemon=True
        )
        self._heartbeat.start()

    def _write_record(self) -> None:
        self._record["alive_at"] = time.time()
        data = json.dumps(self._record).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.fsync(self._fd)  # other clients of a shared volume read what is synced

    def _refresh(self, heartbeat_s: float) -> None:
        while not self._stop.wait(heartbeat_s):
            with contextlib.suppress(OSError):  # a volume failing for a while: the next refresh tries again
                self._beat()

    def _beat(self) -> bool:
        """Refresh the record if it still names this holder; if it names another, the fence was taken
        (:attr:`taken_by`) and nothing is written again. False where the record could not be read whole (one
        being rewritten): it is left as it is."""
        with self._beating:
            if self.taken_by is not None:
                return True
            # A descriptor of its own: on JuiceFS, opening the file is what fetches another client's writes.
            with open(self.path, "rb") as f:
                text = record_text(f.read(4096))
            try:
                found = json.loads(text)
            except ValueError:
                return False
            if not isinstance(found, dict):
                return False
            if holder_identity(found) != holder_identity(self._record):
                self.taken_by = text
                self._stop.set()
                return True
            self._write_record()
            self._confirmed_at = now_boottime()
            return True

    def ensure_held(self) -> None:
        """Raise :class:`QueueTaken` if another holder took the fence; first confirm it (reading the record) where
        the last confirmation is older than ``confirm_after_s``. A record that stays unreadable for
        :data:`UNREADABLE_RECORD_S` is not this holder's any more (the fence is taken as lost); a confirmation the
        volume fails (OSError) leaves the call to meet the volume's error itself."""
        if self.taken_by is None and now_boottime() - self._confirmed_at > self._confirm_after_s:
            deadline = now_boottime() + UNREADABLE_RECORD_S
            with contextlib.suppress(OSError):
                while not self._beat():
                    if now_boottime() > deadline:
                        with open(self.path, "rb") as f:
                            self.taken_by = f"an unreadable record: {f.read(200)!r}"
                        break
                    time.sleep(0.05)
        if self.taken_by is not None:
            raise QueueTaken(
                f"the queue in {os.path.dirname(self.path)} was taken by another controller ({self.taken_by}) while "
                "this one was taken for gone (its host frozen or cut off long enough for the file system to free its "
                "lock); this run stops without writing to it again"
            )

    @classmethod
    def acquire(
        cls,
        data_dir: str,
        *,
        stale_wait_s: float = STALE_HOLDER_WAIT_S,
        say: Callable[[str], None] = print,
        heartbeat_s: float = HEARTBEAT_S,
        silent_after_s: float = SILENT_AFTER_S,
        confirm_after_s: float | None = None,
    ) -> QueueFence:
        """Take the fence of the queue in ``data_dir``; a holder known dead (:func:`holder_is_dead`, with
        ``silent_after_s``) is waited out for up to ``stale_wait_s``; a live one raises :class:`QueueBusy`. The
        fence's record is refreshed every ``heartbeat_s`` until :meth:`release`, and confirmed before a call on the
        queue once ``confirm_after_s`` (default :data:`CONFIRM_AFTER_S`) passed without (:meth:`ensure_held`)."""
        os.makedirs(data_dir, exist_ok=True)
        path = os.path.join(data_dir, "controller.lock")
        deadline = None
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = ""
                try:
                    holder = record_text(os.pread(fd, 4096, 0))
                finally:
                    os.close(fd)
            if not holder_is_dead(holder, silent_after_s=silent_after_s):
                raise QueueBusy(
                    f"the queue in {data_dir} is driven by another live controller ({holder or 'unknown'}); "
                    "stop that run or use another --rollout-data-dir"
                )
            if deadline is None:
                deadline = time.monotonic() + stale_wait_s
                say(
                    f"the queue in {data_dir} is still locked for a controller that is gone ({holder}"
                    f"{silence(holder)}): waiting up to {stale_wait_s:.0f}s for the file system to release the "
                    "lock (on JuiceFS: the session of a client that died expires)"
                )
            if time.monotonic() >= deadline:
                raise QueueBusy(
                    f"the queue in {data_dir} is still locked for a controller that is gone ({holder}) after "
                    f"{stale_wait_s:.0f}s: its file system keeps the lock (on JuiceFS, for the session of a client "
                    "that died, until the session expires; docs/juicefs.md); retry later"
                )
            time.sleep(RETRY_S)
        try:
            return cls(fd, path, heartbeat_s, CONFIRM_AFTER_S if confirm_after_s is None else confirm_after_s)
        except BaseException:
            os.close(fd)  # its record could not be written: the lock goes with the descriptor
            raise

    def release(self) -> None:
        if self._fd >= 0:
            self._stop.set()
            self._heartbeat.join(timeout=30)
            if self.taken_by is None:  # a taken fence's lock is the new holder's: closing is all that is left
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
