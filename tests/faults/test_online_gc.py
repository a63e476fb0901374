"""--rollout-queue-online-gc keeps a long run's disk use bounded, and never reclaims what the
surviving lineage still needs."""

from __future__ import annotations

import os

import pytest

from tests.faults.conftest import NUM_PROMPTS

pytestmark = pytest.mark.integration


def pack_bytes(data_dir: str) -> int:
    raw = os.path.join(data_dir, "raw")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(raw) for f in files)


def test_online_gc_bounds_disk_use_and_keeps_the_resumable_state(job):
    from vime.queue.journal_view import JournalView
    from vime.recovery import checkpoint as ckpt

    # with retention beside it (recovery/retention.py): the last two checkpoints and every 4th step stay
    common = ("--rollout-queue-segment-mib", "0.02", "--save-retain-last", "2", "--save-retain-interval", "4")
    code, log = job.run(*common, "--rollout-queue-online-gc", epochs=4)
    assert code == 0, log[-3000:]
    last = 4 * NUM_PROMPTS // 2  # steps of 2 prompts, a checkpoint every 2nd step
    assert ckpt.complete_steps(job.save) == [*range(4, last - 3, 4), last - 2, last], os.listdir(job.save)
    assert "deleted checkpoint step(s) 2 in" in log
    with_gc = pack_bytes(job.data_dir)
    _, state = ckpt.load_state(job.save)
    accepted = JournalView.read(job.data_dir).accepted()
    assert state.consumer_cursor == len(accepted) == 4 * NUM_PROMPTS
    # Without collection the packs would hold at least every accepted group's payload (measured: 0.31 of it
    # is left with collection; without it the packs held 8 times it, framing and partial groups included).
    written = sum(group.ref.payload_bytes for group in accepted)
    assert with_gc < 0.5 * written, (with_gc, written)
    # resuming the latest checkpoint still works (nothing it needs was reclaimed) ...
    code, log = job.run(*common, "--rollout-queue-online-gc", epochs=4)
    assert code == 0 and "resuming from" in log, log[-3000:]
    # ... an older one, whose groups were reclaimed, is refused with a clear error
    code, log = job.run(*common, "--rollout-queue-online-gc", "--ckpt-step", "4", epochs=4)
    assert code == 1
    assert "were reclaimed by --rollout-queue-online-gc" in log


def test_queue_gc_on_a_killed_run_reclaims_and_keeps_it_resumable(job):
    import subprocess
    import sys
    import time

    from tests.conftest import REPO
    from tests.faults.conftest import check_invariants

    common = ("--rollout-queue-segment-mib", "0.02")
    proc = job.start(*common, epochs=3)
    deadline = time.monotonic() + 300  # start-up and ten steps with checkpoints, on a loaded machine
    while not os.path.exists(os.path.join(job.save, "iter_0000010")):
        assert proc.poll() is None and time.monotonic() < deadline, job.last_log()[-2000:]
        time.sleep(0.2)
    job.kill(proc)  # the whole job, as a lost machine: its writers die with unfinished work
    before = pack_bytes(job.data_dir)
    result = subprocess.run(
        [sys.executable, "-m", "vime.cli", "queue", "gc", "--rollout-data-dir", job.data_dir],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(result.stdout)
    assert report["writers_retired"] >= 1
    assert report["reclaimed_bytes"] > 0 and pack_bytes(job.data_dir) < before
    code, log = job.run(*common, epochs=3)
    assert code == 0, log[-3000:]
    check_invariants(job, epochs=3, readable_before_cursor=False)
