"""A run's controller holding the queue's fence, as a process of another host (tests/juicefs.py's client_host):
takes ``QueueFence`` of the queue folder argv[1], refreshing its record every argv[2] seconds, says "held" and
keeps it until it is killed."""

from __future__ import annotations

import sys
import time

from vime.queue.fence import QueueFence

if __name__ == "__main__":
    fence = QueueFence.acquire(sys.argv[1], heartbeat_s=float(sys.argv[2]))
    print("held", flush=True)
    while True:
        time.sleep(3600)
