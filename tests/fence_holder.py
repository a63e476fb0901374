"""A run's controller holding the queue's fence, as a process of another host (tests/juicefs.py's client_host):
takes ``QueueFence`` of the queue folder argv[1], refreshing its record every argv[2] seconds, says "held" and
keeps it until it is killed.

With argv[3] (the fence's ``confirm_after_s``) it also writes to the queue as a controller does, each write made
only once :meth:`QueueFence.ensure_held` let it: every 0.1 s it appends the time the write began to
``writes-<pid>`` in the queue folder (fsynced), until ensure_held raises; then it says "taken: <the error>" and
exits with status 3."""

from __future__ import annotations

import os
import sys
import time

from vime.queue.fence import QueueFence, QueueTaken

TAKEN_STATUS = 3

if __name__ == "__main__":
    queue, refresh_s = sys.argv[1], float(sys.argv[2])
    confirm_after_s = float(sys.argv[3]) if len(sys.argv) > 3 else None
    fence = QueueFence.acquire(queue, heartbeat_s=refresh_s, confirm_after_s=confirm_after_s)
    print("held", flush=True)
    if confirm_after_s is None:
        while True:
            time.sleep(3600)
    with open(os.path.join(queue, f"writes-{os.getpid()}"), "a") as writes:
        while True:
            # Stamped before the check: a write the host froze in the middle of (past its check) keeps the time it
            # began, which is before the freeze; one that began after it would say so.
            began = time.time()
            try:
                fence.ensure_held()
            except QueueTaken as error:
                print(f"taken: {error}", flush=True)
                os._exit(TAKEN_STATUS)  # nothing more: the queue is the new holder's
            writes.write(f"{began}\n")
            writes.flush()
            os.fsync(writes.fileno())
            time.sleep(0.1)
