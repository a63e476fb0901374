"""The controller's fence (queue/fence.py) on a real JuiceFS volume, held from another host: a live holder there is
refused at once, and one whose host was lost (its JuiceFS client and its process killed together) is waited out
until JuiceFS expires the dead client's session and frees its lock; one whose host was only frozen, and comes back
after its fence was taken, writes to the queue no more. Another host: a second JuiceFS client in a mount namespace
and a UTS namespace of its own (tests/juicefs.py's client_host), so that its hostname differs and its processes
cannot be seen as this host's."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from tests.fence_holder import TAKEN_STATUS
from tests.juicefs import client_host, juicefs_volume
from vime.queue.fence import QueueBusy, QueueFence

pytestmark = pytest.mark.integration

HOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fence_holder.py")
# Both clients beat every 2 s, so that JuiceFS finds the lost client's session stale in about 10 s (a minute with
# its default of 12 s); the holder refreshes its record every 0.5 s and is taken as gone after 3 s of silence.
HEARTBEAT = ("--heartbeat", "2")
REFRESH_S, SILENT_AFTER_S = 0.5, 3.0


def holder_record(path: str) -> dict:
    with open(path) as f:
        return json.loads(f.read().strip("\x00") or "{}")


def wait_held(host, lock: str, timeout: float = 60) -> dict:
    """Until the holder on ``host`` says it holds the fence and its record is read through this client."""
    deadline = time.monotonic() + timeout
    while "held" not in open(host.log).read():
        host.check_alive()
        assert time.monotonic() < deadline, open(host.log).read()
        time.sleep(0.1)
    # Its record, refreshed through its own client, is read through this one once this client's entry and
    # attribute caches (a second each by default) have expired.
    while not os.path.exists(lock) or not holder_record(lock):
        assert time.monotonic() < deadline, "the holder's record is not seen through the first client"
        time.sleep(0.2)
    return holder_record(lock)


def test_a_fence_held_on_a_lost_host_is_waited_out_and_one_held_on_a_live_host_is_refused(tmp_path):
    with juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT) as mount_point:
        queue = os.path.join(mount_point, "rollout_data")
        os.makedirs(queue)
        lock = os.path.join(queue, "controller.lock")
        program = [sys.executable, HOLDER, queue, str(REFRESH_S)]
        with client_host(mount_point, program, *HEARTBEAT, root=str(tmp_path / "host2"), hostname="lost-host") as host:
            first = wait_held(host, lock)
            assert first["host"] == "lost-host", first
            time.sleep(4 * REFRESH_S)
            assert holder_record(lock)["alive_at"] > first["alive_at"]
            started = time.monotonic()
            with pytest.raises(QueueBusy, match=r"driven by another live controller \(\{\"host\": \"lost-host\""):
                QueueFence.acquire(queue, stale_wait_s=120, silent_after_s=SILENT_AFTER_S)
            assert time.monotonic() - started < 5
            # The host is lost: its client dies, and the holder with it, nothing of the holder's death reaching the
            # volume (killed together, on a loaded machine the holder's closing of the lock file could reach the
            # client before it died and free the lock at once: 5 runs in 8 beside three busy loops). Its lock stays
            # in the volume's metadata with the dead client's session; the holder's record goes silent.
            host.kill(client_first=True)
            time.sleep(SILENT_AFTER_S + 0.5)
            said: list[str] = []
            started = time.monotonic()
            fence = QueueFence.acquire(queue, stale_wait_s=120, silent_after_s=SILENT_AFTER_S, say=said.append)
            waited = time.monotonic() - started
            try:
                assert len(said) == 1, said
                assert "still locked for a controller that is gone" in said[0] and '"host": "lost-host"' in said[0]
                assert ", silent for " in said[0], said[0]
                assert holder_record(lock)["host"] == socket.gethostname()
                print(f"taken {waited:.1f}s after the holder fell silent")
            finally:
                fence.release()


def test_a_holder_whose_host_comes_back_after_its_fence_was_taken_writes_to_the_queue_no_more(tmp_path):
    """The host is frozen (every process of it stopped, its JuiceFS client too) long enough for JuiceFS to expire
    its client's session; another controller takes the fence; then the host comes back, and its client and holder
    carry on. Measured before the guard: the old holder went on writing, and rewrote its record over the new
    holder's."""
    with juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT) as mount_point:
        queue = os.path.join(mount_point, "rollout_data")
        os.makedirs(queue)
        lock = os.path.join(queue, "controller.lock")
        # The holder writes to the queue every 0.1 s, each write let through by ensure_held, which confirms the
        # fence (reading its record) once a second has passed without.
        program = [sys.executable, HOLDER, queue, str(REFRESH_S), "1.0"]
        with client_host(mount_point, program, *HEARTBEAT, root=str(tmp_path / "host2"), hostname="lost-host") as host:
            assert wait_held(host, lock)["host"] == "lost-host"
            time.sleep(1)
            frozen = host.freeze()
            time.sleep(SILENT_AFTER_S + 0.5)
            fence = QueueFence.acquire(queue, stale_wait_s=120, silent_after_s=SILENT_AFTER_S, say=lambda _: None)
            try:
                taken = holder_record(lock)
                assert taken["host"] == socket.gethostname(), taken
                host.thaw(frozen)
                deadline = time.monotonic() + 60
                while host.proc.poll() is None:
                    assert time.monotonic() < deadline, "the old holder came back and goes on writing to the queue"
                    time.sleep(0.2)
                said = open(host.log).read()
                assert host.proc.returncode == TAKEN_STATUS, said
                assert f"taken: the queue in {queue} was taken by another controller" in said, said
                assert f'"since": {taken["since"]}' in said, said
                # Nothing of the old holder's after the takeover: every write it began, it began before (one it
                # was in the middle of when frozen may land after: a file system cannot refuse that), and the
                # record is still the new holder's (read again a few of its refreshes later).
                [writes] = [name for name in os.listdir(queue) if name.startswith("writes-")]
                with open(os.path.join(queue, writes)) as f:
                    times = [float(line) for line in f.read().split()]
                assert times and max(times) < taken["since"], (max(times), taken["since"])
                time.sleep(4 * REFRESH_S)
                assert holder_record(lock)["since"] == taken["since"], holder_record(lock)
            finally:
                fence.release()
