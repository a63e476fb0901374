"""A real `vime train` SIGKILLed (its whole process group, or the driver alone as the OOM killer does)
leaves no process behind: the run's reaper stops what the kill did not reach (vime/runtime/reaper.py),
and the harness (Job.kill) sweeps nothing before it asserts so. When the reaper is killed too, the next
run on the same queue stops what was left and says so (vime/runtime/incarnations.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults.conftest import check_invariants, job_processes
from vime.runtime import incarnations
from vime.runtime.process import RUN_TOKEN_ENV, processes_with_tokens

pytestmark = pytest.mark.integration


def _last_step(log: str) -> int:
    steps = re.findall(r"^step +(\d+)/", log, re.MULTILINE)
    return int(steps[-1]) if steps else 0


def _start_and_train(job, steps: int) -> tuple[subprocess.Popen, incarnations.Incarnation]:
    """Start the job and wait until it reported ``steps`` steps (so a checkpoint exists); its record.
    The run is held before the step after those (recovery/faults.py), so that the kill lands mid-run
    however fast the machine is."""
    proc = job.start(
        env={
            "VIME_FAULT_HOLDS": f"driver.before_step={steps + 1}",
            "VIME_FAULT_RELEASE": os.path.join(job.root, "never-released"),
        }
    )
    deadline = time.monotonic() + 300
    while _last_step(job.last_log()) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, job.last_log()[-3000:]
        time.sleep(0.1)
    record = next(r for r in incarnations.read(job.data_dir) if r.pid == proc.pid)
    return proc, record


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE  # a zombie: dead, its parent has not reaped it
    except psutil.NoSuchProcess:
        return False


def _names(token: str) -> list[str]:
    names = []
    for proc in processes_with_tokens([token]).get(token, []):
        try:
            names.append(" ".join(proc.cmdline()[:2]) or proc.name())
        except psutil.Error:
            continue
    return names


# A kill of the whole process group is every fault test's (Job.kill asserts nothing is left after it, e.g.
# test_whole_job_killed_at_random_instants); here the kill the OOM killer makes: the driver alone.
def test_hard_killed_driver_leaves_no_process_and_the_run_resumes(job, driver_only=True):
    proc, record = _start_and_train(job, 3)
    names = " | ".join(_names(record.token))
    # The processes a kill without the reaper would leave (re-parented to PID 1) carry the run's token:
    # Ray's own processes of the in-process cluster and its workers (the controller, trainer, rollout worker).
    for name in ("gcs_server", "raylet", "ray::Controller", "ray::TrainerWorker", "ray::RolloutWorker"):
        assert name in names, (name, names)
    assert proc.poll() is None, job.last_log()[-3000:]
    killed = time.monotonic()
    job.kill(proc, driver_only=driver_only)  # asserts that nothing of the job is left within LEAK_BOUND_S
    print(f"nothing of the killed job left after {time.monotonic() - killed:.1f}s")
    assert "is gone without its teardown" in open(os.path.join(job.run_dir, "logs", "reaper.log")).read()
    code, log = job.run()
    assert code == 0, log[-3000:]
    assert "resuming from" in log
    assert "left by an earlier run" not in log, log[-3000:]  # the reaper had stopped everything
    check_invariants(job)


def test_the_next_run_stops_what_a_run_killed_with_its_reaper_left(job):
    proc, record = _start_and_train(job, 3)
    # Everything of vime killed at once (kill -9 of every vime process): the reaper first, then the driver.
    reaper = psutil.Process(record.reaper_pid)
    reaper.kill()
    deadline = time.monotonic() + 10
    while _running(reaper):
        assert time.monotonic() < deadline, "the reaper survived SIGKILL"
        time.sleep(0.05)
    # Something of the run that outlives both, as vLLM's EngineCore does after its API server's death.
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, RUN_TOKEN_ENV: record.token},
        start_new_session=True,
    )
    try:
        assert proc.poll() is None, job.last_log()[-3000:]
        proc.kill()
        proc.wait(30)
        time.sleep(3)
        _, left = job_processes(job.data_dir, job.run_dir, proc.pid)
        assert orphan.pid in [p.pid for p in left]
        code, log = job.run()
        assert code == 0, log[-3000:]
        said = [line for line in log.splitlines() if "left by an earlier run" in line]
        assert len(said) == 1 and f"(token {record.token[:12]}, driver pid {proc.pid}" in said[0], said
        assert f"{orphan.pid} (" in said[0], said
        assert orphan.poll() is not None, "the start-up sweep left the earlier run's orphan"
        stopped = int(re.search(r"stopped (\d+) process\(es\)", said[0]).group(1))
        print(f"the next start stopped {stopped} process(es): {said[0]}")
        assert not processes_with_tokens([record.token]), "a process of the killed run is still alive"
        check_invariants(job)
    finally:
        if orphan.poll() is None:
            orphan.kill()
        orphan.wait()
