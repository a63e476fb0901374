"""Storage faults on a real JuiceFS volume (issue 18, point 5; docs/juicefs.md).

The queue's JuiceFS client (the mount the driver, the controller and the trainer read and write through) is
SIGKILLed while the run trains: the mount stays listed, and every call on it answers ENOTCONN ("Transport endpoint
is not connected"). The run must stop by itself within a bounded time with one line naming --rollout-data-dir and
how to resume (no traceback), and after the volume is mounted again, `--load` finishes the epoch with every prompt
trained exactly once (the invariants read back from the volume).

The test mounts a volume of its own (the session's volume is shared with other tests), and kills nothing but the
client: whatever the run leaves behind is the harness's leak check's to find, not this test's to clean.
(Redis metadata, whose server could be restarted mid-run, is not installable on this machine; the volume's
metadata is SQLite, which has no server.)
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.faults.conftest import EXAMPLE, NUM_PROMPTS, Job, check_invariants
from tests.juicefs import juicefs_volume, kill_client, mount_again

pytestmark = pytest.mark.integration

# JuiceFS keeps the dead client's locks (the controller's fence) until its session expires, which it finds by the
# missing heartbeats: 65 s after the remount with the default 12 s heartbeat, less with a shorter one. The resume
# waits it out either way (queue/fence.py); a short heartbeat only saves CI the time.
HEARTBEAT = ("--heartbeat", "2")
# From the client's death to the run's exit: the next call on the queue fails at once; the rest is the teardown
# of a run whose queue is gone, on a loaded 2-core machine.
STOP_BOUND_S = 180


def test_the_queue_client_killed_mid_run_stops_it_naming_the_flag_and_load_resumes(tmp_path, fault_model):
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        (tmp_path / "prompts.jsonl").write_text("".join(f.readlines()[:NUM_PROMPTS]))
    with juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT) as mount_point:
        queue_dir = os.path.join(mount_point, "rollout_data")
        job = Job(str(tmp_path), fault_model, queue_dir=queue_dir, storage_profile="juicefs")
        # Slow steps (1 s each), so that the run is still training when the client dies.
        proc = job.start(env={"VIME_FAULT_DELAYS": "trainer.mid_step=1"})
        deadline = time.monotonic() + 240
        while "step    3/" not in job.last_log():
            assert proc.poll() is None, f"the run ended before step 3:\n{job.last_log()[-3000:]}"
            assert time.monotonic() < deadline, f"no step 3 within 240 s:\n{job.last_log()[-3000:]}"
            time.sleep(0.2)
        assert kill_client(mount_point), "no JuiceFS client process found for the mount"
        killed = time.monotonic()
        try:
            code = proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            job.kill(proc)  # the test failed: do not leave the run behind
            pytest.fail(f"the run did not stop within {STOP_BOUND_S} s of its queue client's death")
        log = job.last_log()
        assert code == 1, log[-3000:]
        assert f"the volume of --rollout-data-dir {queue_dir} is not reachable any more" in log, log[-3000:]
        assert f"resume with --load {job.save}" in log and "Traceback" not in log, log[-3000:]
        print(f"stopped {time.monotonic() - killed:.1f} s after the client's death")

        mount_again(mount_point, *HEARTBEAT)
        resumed = time.monotonic()
        code, log = job.run()
        assert code == 0, log[-3000:]
        assert "resuming from" in log
        print(f"resumed and finished in {time.monotonic() - resumed:.1f} s")
        check_invariants(job)
