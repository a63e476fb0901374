"""The queue's volume fills while a real `vime train` goes on (issue 23, point 3; recovery/disk_full.py): the
run stops with one clear line naming --rollout-data-dir, and once space is freed --load finishes the epoch
with every prompt trained exactly once, read from what is on disk.

Engine-free (tests/plugins/steady_rollout.py, as the rest of tests/faults/): the subject is the queue, straw's
coordinator and journal on a full volume, the rollout worker's publishes and acceptances, the driver's calls
on the queue and its commit; every one of them is the real one, on a real small tmpfs of the test's own."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.faults.conftest import check_invariants
from tests.tmpfs import mounted_tmpfs
from tests.unit.test_disk_full import fill

pytestmark = pytest.mark.integration


def test_a_queue_volume_that_fills_mid_run_stops_it_clearly_and_load_resumes_once_space_is_freed(job):
    fewer_steps = ("--rollout-batch-size", "4", "--no-save-hf")  # 6 steps an epoch: the point needs no more
    release = os.path.join(job.root, "release")
    # The run is held before step 2 until the volume is full: its queue cannot finish the epoch before that.
    holds = {"VIME_FAULT_HOLDS": "driver.before_step=2", "VIME_FAULT_RELEASE": release}
    with mounted_tmpfs(job.data_dir, size="16m") as volume:
        proc = job.start(*fewer_steps, env=holds)
        try:
            deadline = time.monotonic() + 240  # start-up and one step, on a loaded machine
            while not re.search(r"^step +1/", job.last_log(), re.M):
                assert proc.poll() is None and time.monotonic() < deadline, job.last_log()[-3000:]
                time.sleep(0.2)
            ballast = fill(volume)  # what is left of the queue's volume goes to another writer
            open(release, "w").close()
            proc.wait(timeout=180)
        finally:
            job.kill(proc)  # nothing of the run may be left running, whatever it did
        log = job.last_log()
        assert proc.returncode == 1, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("vime train: error:")]
        assert len(errors) == 1, log[-3000:]
        assert errors[0].startswith(f"vime train: error: the volume of --rollout-data-dir {job.data_dir} is full: ")
        assert f"resume with --load {job.save} (nothing accepted is lost, nothing is trained twice)" in errors[0]
        assert "Traceback" not in log.split(errors[0])[1]  # the driver said it in one line, nothing after
        os.unlink(ballast)  # space is freed
        code, log = job.run(*fewer_steps)
        assert code == 0, log[-3000:]
        assert "resuming from" in log
        check_invariants(job)  # every prompt trained exactly once, every trained group readable
