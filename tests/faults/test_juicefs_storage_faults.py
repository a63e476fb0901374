"""Storage faults on a real JuiceFS volume (issue 18, point 5; docs/juicefs.md).

The queue's JuiceFS client (the mount the driver, the controller and the trainer read and write through) is
SIGKILLed while the run trains: the mount stays listed, and every call on it answers ENOTCONN ("Transport endpoint
is not connected"). The run must stop by itself within a bounded time with one line naming --rollout-data-dir and
how to resume (no traceback), and after the volume is mounted again, `--load` finishes the epoch with every prompt
trained exactly once (the invariants read back from the volume).

The volume's metadata server, Redis, is SIGKILLed while the run trains and started again 10 s later on its data
(appended and fsynced: nothing it answered is lost): the JuiceFS client holds every call on the volume meanwhile
and goes on when Redis is back, and so does the run, with every prompt trained exactly once.

Each test mounts a volume of its own (the session's volume is shared with other tests), and kills nothing but the
client or the metadata server: whatever the run leaves behind is the harness's leak check's to find, not this
test's to clean.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.faults.conftest import EXAMPLE, NUM_PROMPTS, Job, check_invariants
from tests.juicefs import juicefs_volume, kill_client, mount_again, redis_metadata

pytestmark = pytest.mark.integration

# JuiceFS keeps the dead client's locks (the controller's fence) until its session expires, which it finds by the
# missing heartbeats: 65 s after the remount with the default 12 s heartbeat, less with a shorter one. The resume
# waits it out either way (queue/fence.py); a short heartbeat only saves CI the time.
HEARTBEAT = ("--heartbeat", "2")
# From the client's death to the run's exit: the next call on the queue fails at once; the rest is the teardown
# of a run whose queue is gone, on a loaded 2-core machine.
STOP_BOUND_S = 180
# How long the metadata server stays down: longer than a step (1 s here) and than the rollout worker's heartbeat
# interval, shorter than the time JuiceFS's client keeps retrying a metadata call before it fails it.
REDIS_OUTAGE_S = float(os.environ.get("VIME_TEST_REDIS_OUTAGE_S", "10"))  # longer outages: by hand


def slow_run_at_step_3(
    tmp_path, fault_model, mount_point: str, *, release: str | None = None
) -> tuple[Job, subprocess.Popen]:
    """A run of the harness's job with its queue on ``mount_point``, its steps slowed to 1 s each so that it is
    still training when the fault comes, started and waited for until it logs step 3. ``release``: the run is
    also held before its 5th step until that file exists (it cannot end before a fault that must find it
    running, however fast the machine)."""
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        (tmp_path / "prompts.jsonl").write_text("".join(f.readlines()[:NUM_PROMPTS]))
    queue_dir = os.path.join(mount_point, "rollout_data")
    job = Job(str(tmp_path), fault_model, queue_dir=queue_dir, storage_profile="juicefs")
    hold = {"VIME_FAULT_HOLDS": "driver.before_step=5", "VIME_FAULT_RELEASE": release} if release else {}
    proc = job.start(env={"VIME_FAULT_DELAYS": "trainer.mid_step=1", **hold})
    deadline = time.monotonic() + 240
    while "step    3/" not in job.last_log():
        assert proc.poll() is None, f"the run ended before step 3:\n{job.last_log()[-3000:]}"
        assert time.monotonic() < deadline, f"no step 3 within 240 s:\n{job.last_log()[-3000:]}"
        time.sleep(0.2)
    return job, proc


def test_the_queue_client_killed_mid_run_stops_it_naming_the_flag_and_load_resumes(tmp_path, fault_model):
    with juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT) as mount_point:
        job, proc = slow_run_at_step_3(tmp_path, fault_model, mount_point)
        queue_dir = job.data_dir
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


def test_the_metadata_server_killed_and_restarted_mid_run_is_ridden_out_or_stops_clearly(tmp_path, fault_model):
    """Most runs ride the outage out: the client holds each call until Redis is back. A lock that was being waited
    for when Redis died can fail with EIO once it is back: a rollout worker's publication that fails so goes back
    to the queue (the run goes on), any other call stops the run with one line naming --rollout-data-dir, after
    which --load finishes the epoch. Either way every prompt is trained exactly once."""
    with (
        redis_metadata(str(tmp_path / "redis")) as redis,
        juicefs_volume(str(tmp_path / "volume"), *HEARTBEAT, meta=redis.url) as mount_point,
    ):
        release = tmp_path / "release"
        job, proc = slow_run_at_step_3(tmp_path, fault_model, mount_point, release=str(release))
        client_log = os.path.join(os.path.dirname(mount_point), "juicefs.log")
        refused_before = open(client_log).read().count("connection refused")
        assert proc.poll() is None, f"the run ended before its metadata server died:\n{job.last_log()[-3000:]}"
        redis.kill()
        time.sleep(REDIS_OUTAGE_S)
        assert open(client_log).read().count("connection refused") > refused_before  # the client did miss it
        redis.start()  # a run that stopped meanwhile (the clear stop below) is resumed once Redis is back
        release.touch()  # the run, held before its 5th step, was still running through the whole outage
        try:
            code = proc.wait(timeout=STOP_BOUND_S + 120)
        except subprocess.TimeoutExpired:
            job.kill(proc)  # the test failed: do not leave the run behind
            pytest.fail(f"the run did not end within {STOP_BOUND_S + 120} s of its metadata server's restart")
        log = job.last_log()
        assert "Traceback" not in log, log[-3000:]
        if code != 0:
            assert code == 1, log[-3000:]
            said = f"the volume of --rollout-data-dir {job.data_dir} failed a call: "
            assert said in log and f"resume with --load {job.save}" in log, log[-3000:]
            print(f"stopped: {log[log.index(said) :].splitlines()[0]}")
            code, log = job.run()
            assert code == 0 and "resuming from" in log, log[-3000:]
        else:
            restarted = "the controller was restarted" in log  # its journal write failed: a new one recovered it
            print("rode the outage out" + (" (the controller restarted)" if restarted else ""))
        check_invariants(job)  # every prompt trained exactly once
