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

from vime.queue.fence import SILENT_AFTER_S, QueueBusy, QueueFence, QueueTaken, holder_is_dead
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


def taken_over(path: str) -> str:
    """Another controller's record written over the holder's, as one that took the fence writes it (on a local file
    system the holder's flock cannot be taken from it: the record is what the holder reads)."""
    other = record(7, 1.0, host="another-host")
    with open(path, "w") as f:
        f.write(other)
    return other


def test_a_holder_whose_fence_was_taken_refuses_every_call_after_and_never_writes_its_record_again(tmp_path):
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=3600, confirm_after_s=0)
    fence.ensure_held()  # still its own
    other = taken_over(fence.path)
    for _ in range(2):
        with pytest.raises(QueueTaken, match=r"was taken by another controller \(\{\"host\": \"another-host\""):
            fence.ensure_held()
    assert fence.taken_by == other
    fence.release()  # leaves the record (and the lock, which is the new holder's) alone
    with open(fence.path) as f:
        assert f.read() == other


def test_the_refresh_finds_the_fence_taken_by_itself_and_stops(tmp_path):
    # A recent confirmation lets a call through without reading the record; the refresh reads it at its next beat.
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=0.1, confirm_after_s=3600)
    other = taken_over(fence.path)
    deadline = time.monotonic() + 30
    while fence.taken_by is None:
        assert time.monotonic() < deadline, "the refresh never read the new holder's record"
        time.sleep(0.05)
    with pytest.raises(QueueTaken):
        fence.ensure_held()
    time.sleep(0.3)
    with open(fence.path) as f:
        assert f.read() == other  # not refreshed over it
    fence.release()


def test_a_record_seen_at_an_older_longer_size_is_still_the_holders(tmp_path):
    # A JuiceFS client can read a record rewritten shorter at its former size, the tail zeros (measured).
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=3600, confirm_after_s=0)
    with open(fence.path, "rb") as f:
        own = f.read()
    with open(fence.path, "wb") as f:
        f.write(own + b"\0" * 8)
    fence.ensure_held()
    with open(fence.path, "rb") as f:
        refreshed = json.loads(f.read())
    assert refreshed["pid"] == os.getpid() and refreshed["alive_at"] > json.loads(own)["alive_at"]
    fence.release()


def test_a_record_that_stays_unreadable_is_taken_as_lost(tmp_path):
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=3600, confirm_after_s=0)
    with open(fence.path, "w") as f:
        f.write('{"host": "another-h')
    started = time.monotonic()
    with pytest.raises(QueueTaken, match="an unreadable record"):
        fence.ensure_held()
    assert 0.9 < time.monotonic() - started < 10  # retried for UNREADABLE_RECORD_S first
    fence.release()


def test_a_confirmation_the_volume_fails_leaves_the_call_to_meet_the_volume(tmp_path):
    fence = QueueFence.acquire(str(tmp_path), heartbeat_s=3600, confirm_after_s=0)
    # Opening the record by its name fails (ENOENT), as a call on a failing volume would.
    os.rename(fence.path, fence.path + ".moved")
    fence.ensure_held()
    assert fence.taken_by is None
    fence.release()


def queue_files(folder: str) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file of the queue but the fence's record."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            if name != "controller.lock":
                stat = os.stat(os.path.join(parent, name))
                found[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_a_controller_whose_queue_was_taken_refuses_its_calls_and_writes_nothing_more(tmp_path, monkeypatch):
    from tests.controller_spec import controller_spec, write_prompts
    from vime.queue import fence as fence_module
    from vime.workers.controller import Controller

    monkeypatch.setattr(fence_module, "CONFIRM_AFTER_S", 0.0)  # every call confirms the fence first
    controller = Controller(controller_spec(tmp_path, write_prompts(tmp_path, 8)))
    assert controller.lease("w", 1)
    queue = str(tmp_path / "queue")
    before = queue_files(queue)
    taken_over(os.path.join(queue, "controller.lock"))
    with pytest.raises(QueueTaken, match="this run stops without writing to it again"):
        controller.lease("w", 1)
    with pytest.raises(QueueTaken):
        controller.stats()
    controller.shutdown()  # leaves the queue to its new holder: not even closed from here
    assert queue_files(queue) == before
