"""A volume that fills while a real `vime train` goes on (issue 23, point 3; recovery/disk_full.py): the queue's
(--rollout-data-dir), the checkpoints' (--save) during a checkpoint write, the weights' (--update-weight-disk-dir)
during a publication. Each run stops with one clear line naming the flag and the directory, leaves nothing
half-written visible, and once space is freed --load finishes the epoch with every prompt trained exactly once,
read from what is on disk.

Engine-free (tests/plugins/steady_rollout.py, as the rest of tests/faults/): the subject is the run's writes on a
full volume, straw's coordinator and journal, the rollout worker's publishes and acceptances, the driver's calls on
the queue and its commit, the checkpoint write, the trainer's weight publication; every one of them is the real
one, on a real small tmpfs of the test's own (tests/tmpfs.py)."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.faults.conftest import Job, check_invariants
from tests.tmpfs import mounted_tmpfs
from tests.unit.test_disk_full import fill
from vime.recovery import checkpoint as ckpt
from vime.weights import disk as weights

pytestmark = pytest.mark.integration

FEWER_STEPS = ("--rollout-batch-size", "4", "--no-save-hf")  # 6 steps an epoch: the point needs no more


def stops_when_the_volume_fills(job: Job, volume: str, flag: str, *extra: str, after_step: int) -> str:
    """Run `vime train` until ``after_step`` is done, held before the next step (VIME_FAULT_HOLDS) until
    ``volume`` is full; then it goes on and must stop with one line naming ``flag`` and ``volume``, and nothing
    after it. Returns the ballast file whose removal frees the space again."""
    release = os.path.join(job.root, "release")
    holds = {"VIME_FAULT_HOLDS": f"driver.before_step={after_step + 1}", "VIME_FAULT_RELEASE": release}
    proc = job.start(*FEWER_STEPS, *extra, env=holds)
    try:
        deadline = time.monotonic() + 240  # start-up and the first steps, on a loaded machine
        while not re.search(rf"^step +{after_step}/", job.last_log(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, job.last_log()[-3000:]
            time.sleep(0.2)
        ballast = fill(volume)  # what is left of the volume goes to another writer
        open(release, "w").close()
        proc.wait(timeout=180)
    finally:
        job.kill(proc)  # nothing of the run may be left running, whatever it did
    log = job.last_log()
    assert proc.returncode == 1, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("vime train: error:")]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith(f"vime train: error: the volume of {flag} {volume} is full: "), errors[0]
    assert f"resume with --load {job.save} (nothing accepted is lost, nothing is trained twice)" in errors[0]
    assert "Traceback" not in log.split(errors[0])[1]  # the driver said it in one line, nothing after
    return ballast


def resumes_once_space_is_freed(job: Job, ballast: str, *extra: str) -> None:
    os.unlink(ballast)  # space is freed; the volume stays mounted
    code, log = job.run(*FEWER_STEPS, *extra)
    assert code == 0, log[-3000:]
    assert "resuming from" in log
    check_invariants(job)  # every prompt trained exactly once, every trained group readable


def test_a_queue_volume_that_fills_mid_run_stops_it_clearly_and_load_resumes_once_space_is_freed(job):
    # Held before step 3 until the volume is full: after step 2's checkpoint (--save-interval 2), so that the resume
    # has one to start from whichever write meets the full volume first (the driver's commit of step 3, before any
    # checkpoint of its own, or a rollout worker's publication while the trainer goes on), and before the queue can
    # have finished the epoch (6 steps; the staleness bound keeps the rollout worker at most a step or two ahead).
    with mounted_tmpfs(job.data_dir, size="16m") as volume:
        ballast = stops_when_the_volume_fills(job, volume, "--rollout-data-dir", after_step=2)
        assert (ckpt.latest_step(job.save) or 0) >= 2, job.last_log()[-3000:]
        resumes_once_space_is_freed(job, ballast)


def test_a_save_volume_that_fills_during_a_checkpoint_write_stops_it_clearly_and_load_resumes(job):
    job.queue_dir = os.path.join(job.root, "queue")  # the queue elsewhere: only the checkpoints' volume fills
    # Held before step 3, after step 2's checkpoint (--save-interval 2): step 4's write meets the full volume.
    with mounted_tmpfs(job.save, size="24m") as volume:
        ballast = stops_when_the_volume_fills(job, volume, "--save", after_step=2)
        assert "the checkpoint write of step 4 failed" in job.last_log()
        # nothing half-written is visible or left behind: step 4's staging folder is gone, step 2 loads
        assert sorted(set(os.listdir(volume)) - {os.path.basename(ballast)}) == [ckpt.LOCK, "iter_0000002", ckpt.LATEST]
        assert ckpt.complete_steps(volume) == [2] and ckpt.load_state(volume)[1].step == 2
        resumes_once_space_is_freed(job, ballast)  # --load is the same volume, still mounted


def test_a_weight_volume_that_fills_during_a_publication_stops_it_clearly_and_load_resumes(job):
    weight_dir = os.path.join(job.root, "weights")
    on_its_volume = ("--update-weight-disk-dir", weight_dir)
    # Held before step 3, after step 2's checkpoint: step 3's publication meets the full volume.
    with mounted_tmpfs(weight_dir, size="8m") as volume:
        ballast = stops_when_the_volume_fills(job, volume, "--update-weight-disk-dir", *on_its_volume, after_step=2)
        assert re.search(r"the publication of weight version \d+ failed", job.last_log())
        # nothing half-written is visible or left behind: every version published verifies, no staging folder
        published = weights.published_versions(volume)
        assert published, "nothing was published before the volume filled: the test proves nothing"
        assert sorted(set(os.listdir(volume)) - {os.path.basename(ballast)}) == [
            os.path.basename(weights.version_dir(volume, v)) for v in published
        ]
        for version in published:
            assert weights.verify(weights.version_dir(volume, version)).version == version
        resumes_once_space_is_freed(job, ballast, *on_its_volume)
