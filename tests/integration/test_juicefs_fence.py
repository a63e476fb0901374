"""The controller's fence (queue/fence.py) on a real JuiceFS volume, held from another host: a live holder there is
refused at once, and one whose host was lost (its JuiceFS client and its process killed together) is waited out
until JuiceFS expires the dead client's session and frees its lock. Another host: a second JuiceFS client in a
mount namespace and a UTS namespace of its own (tests/juicefs.py's client_host), so that its hostname differs and
its processes cannot be seen as this host's."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

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
        return json.loads(f.read() or "{}")


def test_a_fence_held_on_a_lost_host_is_waited_out_and_one_held_on_a_live_host_is_refused(tmp_path):
    with juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT) as mount_point:
        queue = os.path.join(mount_point, "rollout_data")
        os.makedirs(queue)
        lock = os.path.join(queue, "controller.lock")
        program = [sys.executable, HOLDER, queue, str(REFRESH_S)]
        with client_host(mount_point, program, *HEARTBEAT, root=str(tmp_path / "host2"), hostname="lost-host") as host:
            deadline = time.monotonic() + 60
            while "held" not in open(host.log).read():
                host.check_alive()
                assert time.monotonic() < deadline, open(host.log).read()
                time.sleep(0.1)
            # The live holder's record, refreshed through its own client, is read through this one (once this
            # client's entry and attribute caches, a second each by default, have expired).
            while not os.path.exists(lock) or not holder_record(lock):
                assert time.monotonic() < deadline, "the holder's record is not seen through the first client"
                time.sleep(0.2)
            first = holder_record(lock)
            assert first["host"] == "lost-host", first
            time.sleep(4 * REFRESH_S)
            assert holder_record(lock)["alive_at"] > first["alive_at"]
            started = time.monotonic()
            with pytest.raises(QueueBusy, match=r"driven by another live controller \(\{\"host\": \"lost-host\""):
                QueueFence.acquire(queue, stale_wait_s=120, silent_after_s=SILENT_AFTER_S)
            assert time.monotonic() - started < 5
            # The host is lost: its client and the holder die together. Its lock stays in the volume's metadata
            # with the dead client's session; the holder's record goes silent.
            host.kill()
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
