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


class QueueBusy(UserError, RuntimeError):
    """Another live controller holds the queue (or a dead one's lock did not come free in time)."""


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
    def __init__(self, fd: int, path: str, heartbeat_s: float = HEARTBEAT_S):
        self._fd, self.path = fd, path
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start_time(os.getpid())}
        self._record["since"] = time.time()
        self._stop = threading.Event()
        self._write_record()
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
                self._write_record()

    @classmethod
    def acquire(
        cls,
        data_dir: str,
        *,
        stale_wait_s: float = STALE_HOLDER_WAIT_S,
        say: Callable[[str], None] = print,
        heartbeat_s: float = HEARTBEAT_S,
        silent_after_s: float = SILENT_AFTER_S,
    ) -> QueueFence:
        """Take the fence of the queue in ``data_dir``; a holder known dead (:func:`holder_is_dead`, with
        ``silent_after_s``) is waited out for up to ``stale_wait_s``; a live one raises :class:`QueueBusy`. The
        fence's record is refreshed every ``heartbeat_s`` until :meth:`release`."""
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
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
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
            return cls(fd, path, heartbeat_s)
        except BaseException:
            os.close(fd)  # its record could not be written: the lock goes with the descriptor
            raise

    def release(self) -> None:
        if self._fd >= 0:
            self._stop.set()
            self._heartbeat.join(timeout=30)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
