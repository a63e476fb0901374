"""The controller's fence (queue/fence.py) with a lock that outlived its holder, as JuiceFS keeps a flock taken
through a client that died: a holder known dead (this host, its process gone; or another host, its record silent)
is waited out, bounded, saying so; a live holder is refused at once. The stale lock is made here by a live helper
process that holds the flock while the lock file's record names a process that is gone (on a local file system
the kernel would release a dead holder's lock at once, so this is how a unit test gets one; the real cases are
tests/faults/test_juicefs_storage_faults.py and, for another host, tests/integration/test_juicefs_fence.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from vime.queue.fence import SILENT_AFTER_S, QueueBusy, QueueFence, holder_is_dead
from vime.runtime.reaper import process_start_time

HOLD = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
HOLD += "print('held', flush=True); sys.stdin.readline()"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(pid: int, pid_start: float, host: str | None = None) -> str:
    return json.dumps({"host": host or socket.gethostname(), "pid": pid, "pid_start": pid_start, "since": 0.0})


def test_holder_is_dead_only_for_a_gone_process_of_this_host():
    me = process_start_time(os.getpid())
    assert holder_is_dead(record(dead_pid(), me))
    assert not holder_is_dead(record(os.getpid(), me))  # alive
    assert holder_is_dead(record(os.getpid(), me - 3600))  # the pid now belongs to a process started after the holder
    assert not holder_is_dead(record(dead_pid(), me, host="another-host"))  # cannot be seen from here
    assert not holder_is_dead("") and not holder_is_dead("not json") and not holder_is_dead('{"pid": 1}')
    # A record without the holder's start time (written before it was recorded) names no process for sure.
    assert not holder_is_dead(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "since": 0.0}))


class StaleLock:
    """A flock held by a live helper process, under a record naming a process that is gone."""

    def __init__(self, data_dir: str):
        os.makedirs(data_dir, exist_ok=True)
        path = os.path.join(data_dir, "controller.lock")
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == b"held"
        self.record = record(dead_pid(), time.time())  # a start time no live process has
        with open(path, "w") as f:
            f.write(self.record)

    def release(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_a_dead_holders_lock_is_waited_out_and_then_taken(tmp_path):
    stale = StaleLock(str(tmp_path))
    said: list[str] = []
    threading.Timer(1.0, stale.release).start()
    started = time.monotonic()
    fence = QueueFence.acquire(str(tmp_path), stale_wait_s=60, say=said.append)
    assert 0.9 < time.monotonic() - started < 30
    assert len(said) == 1 and "still locked for a controller that is gone" in said[0] and stale.record in said[0]
    with open(fence.path) as f:
        taken = json.loads(f.read())
    assert taken["pid"] == os.getpid() and not holder_is_dead(json.dumps(taken))
    fence.release()


def test_a_dead_holders_lock_that_stays_is_refused_after_the_bound_naming_it(tmp_path):
    stale = StaleLock(str(tmp_path))
    try:
        with pytest.raises(QueueBusy, match="still locked for a controller that is gone .* after 1s"):
            QueueFence.acquire(str(tmp_path), stale_wait_s=1, say=lambda _: None)
    finally:
        stale.release()


def test_a_live_holder_is_refused_at_once(tmp_path):
    fence = QueueFence.acquire(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(QueueBusy, match="driven by another live controller"):
        QueueFence.acquire(str(tmp_path), stale_wait_s=60)
    assert time.monotonic() - started < 5
    fence.release()


def test_a_holder_on_another_host_is_gone_once_its_record_has_been_silent_long_enough():
    now = time.time()

    def elsewhere(alive_at: float) -> str:
        return json.dumps({"host": "another-host", "pid": 1, "pid_start": 1.0, "since": 0.0, "alive_at": alive_at})

    assert not holder_is_dead(elsewhere(now))
    assert holder_is_dead(elsewhere(now - SILENT_AFTER_S - 1))
    assert not holder_is_dead(elsewhere(now - 10), silent_after_s=60) and holder_is_dead(
        elsewhere(now - 10), silent_after_s=5
    )
    # On this host its process decides, whatever the age of its record (a holder busy in a long call is alive).
    here = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start_time(os.getpid())}
    assert not holder_is_dead(json.dumps({**here, "alive_at": now - 3600}))


def test_the_holder_refreshes_its_record_until_it_releases_the_fence(tmp_path):
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=0.1)
    with open(fence.path) as f:
        first = json.loads(f.read())
    time.sleep(0.5)
    with open(fence.path) as f:
        second = json.loads(f.read())
    assert second["alive_at"] > first["alive_at"] and second["since"] == first["since"] and second["pid"] == os.getpid()
    fence.release()
    with open(fence.path) as f:
        last = f.read()
    time.sleep(0.3)
    with open(fence.path) as f:
        assert f.read() == last  # released: no more refreshes
