"""Kill real processes at chosen points (and at random instants); check the invariants on disk."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.faults.conftest import NUM_PROMPTS, check_invariants

# The SIGKILL tests of issue 18's list (trainer, rollout worker, controller, whole job, corrupted payload) run
# their queue on the session's JuiceFS volume (tests/juicefs.py: a real FUSE mount of a real client): payloads
# are made durable, released, journaled and read back through the JuiceFS client, with the same invariants read
# from disk (the checkpoints stay in --save, on a local directory). The other fault tests keep their queue on a
# local directory, so that both kinds of storage stay covered without running any test twice (CI's time).
ON_JUICEFS = pytest.mark.parametrize("job", ["juicefs"], indirect=True)

pytestmark = pytest.mark.integration


def test_a_failed_publication_sync_and_a_failed_journal_write_are_ridden_out_and_every_prompt_trains_once(job):
    """Two file syncs fail with EIO in one run (as a JuiceFS client's can after a metadata outage; the two are
    independent, and one run's start-up is most of such a test's time):

    - a rollout worker's third: that group goes back to the queue, straw cannot tell whether its publication is
      durable and refuses the worker's next ones until it is published again (queue/transport.py does), and the
      run goes on (before that, it hung);
    - the controller's 30th (a journal append of its queue, in the first steps): straw cannot tell whether it
      landed and refuses every call after it until a new owner recovers the queue. The controller ends its
      process (recovery/volume_failure.py), Ray starts a new one that recovers the queue from its journal, the
      calls in flight are answered by it, and the run finishes, saying that the controller was restarted
      (before, the run stopped and needed --load). A volume that keeps failing still stops it:
      tests/unit/test_volume_failure.py; a real metadata outage: test_juicefs_storage_faults.py."""
    failing = {
        "VIME_FAULT_ERRORS": "straw.before_file_sync@3,controller.straw.before_file_sync@30",
        "VIME_FAULT_STATE": job.root,
    }
    code, log = job.run(env=failing, timeout=240)  # ~20 s here; a hang is what it checks
    assert os.path.exists(os.path.join(job.root, "straw.before_file_sync.failed"))  # the syncs did fail
    assert os.path.exists(os.path.join(job.root, "controller.straw.before_file_sync.failed"))
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "vime train: error" not in log, log[-3000:]
    assert "exhausted the prompts" in log
    assert len(re.findall(r"the controller was restarted \(by step \d+\): a new incarnation", log)) == 1, log[-3000:]
    restarts = [r["controller_restarts"] for r in _train_records(job)]
    assert restarts[0] in (0, 1) and restarts[-1] == 1 and restarts == sorted(restarts), restarts
    facts = check_invariants(job)
    assert facts["state"].step == 12
    # resuming with a run-defining option changed is refused, naming it, before anything starts
    code, log = job.run("--n-samples-per-prompt", "4", "--global-batch-size", "8")
    assert code == 1 and "--n-samples-per-prompt: the checkpoint was made with 2, this run has 4" in log
    assert "starting Ray" not in log
    code, log = job.run("--rollout-queue-lease-seconds", "30")
    assert code == 2 or code == 1
    assert "--rollout-queue-lease-seconds: the queue in" in log and "was created with 20.0" in log


@ON_JUICEFS
def test_trainer_killed_mid_step_resumes_from_the_checkpoint(job):
    # Two data-parallel trainer ranks: one of them is killed (the first to reach the point) while the other
    # would wait for it in the step's gradient sum, so the run must stop at once, not at the collective
    # timeout. A single rank's death takes the same path (workers/trainer_group.py), with nobody waiting.
    # --trainer-restart-budget 0: stop and tell, as before restarts in place (with the default budget the
    # run heals itself: tests/faults/test_trainer_restart.py).
    trainer = ["--actor-num-gpus-per-node", "2", "--micro-batch-size", "1"]
    proc = job.start(*trainer, "--trainer-restart-budget", "0", faults="trainer.mid_step@5")
    try:
        proc.wait(timeout=600)
        exited = time.time()
    finally:
        job.kill(proc)
    code, log = proc.returncode, job.last_log()
    assert code == 1, log[-3000:]
    assert "the trainer process died during step 5" in log and "resume with --load" in log
    # From the kill (the marker the fault point writes just before it) to the run's exit: far below the
    # ranks' 30-minute collective timeout.
    killed = os.path.getmtime(os.path.join(job.root, "trainer.mid_step.fired"))
    assert exited - killed < 120, exited - killed
    check_invariants(job, complete=False)
    code, log = job.run(*trainer)
    assert code == 0, log[-3000:]
    assert "resuming from" in log and "step 4" in log and "2 ranks" in log
    check_invariants(job)


# The three points below are independent of each other, so one run hits them all (a run's start-up is most of
# such a test's time): whichever comes first, the run must heal each and train every prompt once.
KILL_POINTS = {
    # the rollout worker, after its third publication is durable and before the controller accepted it
    "rollout.after_publish": 3,
    # a rollout worker (the first, or the one started in its place) in the middle of its fourth generation
    "rollout.mid_generation": 4,
    # the controller in its second commit; Ray restarts it and it recovers the queue from its journal
    "controller.mid_commit": 2,
}


@ON_JUICEFS
def test_rollout_workers_and_the_controller_killed_mid_run_are_replaced_and_every_prompt_trains_once(job):
    code, log = job.run(faults=",".join(f"{point}@{hit}" for point, hit in KILL_POINTS.items()))
    assert code == 0, log[-3000:]
    for point in KILL_POINTS:  # each kill did happen
        assert os.path.exists(os.path.join(job.root, f"{point}.fired")), point
    assert f"opening the straw queue in {job.data_dir}" in log
    assert log.count("rollout worker 0 died") == 2, log[-3000:]
    assert "released 1 unaccepted publication(s)" in log  # the publication the controller never accepted
    check_invariants(job)


def test_whole_job_killed_while_writing_a_checkpoint(job):
    proc = job.start(faults="checkpoint.mid_write@3")
    proc.wait(timeout=240)
    job.kill(proc)
    assert os.path.exists(os.path.join(job.root, "checkpoint.mid_write.fired"))
    from vime.recovery import checkpoint as ckpt

    assert ckpt.latest_step(job.save) == 4  # the third save (step 6) never became visible
    assert not os.path.exists(ckpt.iteration_dir(job.save, 6))
    killed_run = _train_records(job)
    given_out = max(r["weight_version"] for r in killed_run)  # the policy of its last step, published after 5
    assert given_out > 4, killed_run  # it had trained (and published) past the checkpoint
    code, log = job.run()
    assert code == 0, log[-3000:]
    # Versions are never given out twice: the killed run's after the checkpoint are lost (their groups' prompts
    # run again), and the checkpoint's weights are published above them (recovery/lineage.resumed).
    resumed = _train_records(job)[len(killed_run) :]
    assert "the run before gave out weight versions 5-" in log, log[-3000:]
    assert resumed[0]["step"] == 5 and resumed[0]["weight_version"] > given_out, (given_out, resumed[:2])
    restore = check_invariants(job)["state"].lineage.restores[-1]
    assert restore.lost_after == 4 and restore.step == 4 and restore.version > given_out - 1, restore
    lost = range(restore.lost_after + 1, restore.version)
    assert not any(str(v) in r["tokens_per_version"] for r in resumed for v in lost), "a lost version was trained"


def test_a_second_run_on_a_live_queue_is_refused_and_a_run_whose_queue_was_taken_stops_for_a_resume(job):
    # The first run must still hold the queue's fence when the second reaches it, and still be mid-run when its
    # fence is then taken: its trainer is slowed (3 s a step, 48 steps) throughout.
    first = job.start(epochs=4, env={"VIME_FAULT_DELAYS": "trainer.mid_step=3"})
    lock = os.path.join(job.data_dir, "controller.lock")
    try:
        deadline = time.monotonic() + 300
        while "training:" not in job.last_log():
            assert first.poll() is None and time.monotonic() < deadline, job.last_log()[-2000:]
            time.sleep(0.5)
        args = job.args(epochs=4)
        args[args.index("--run-dir") + 1] = os.path.join(job.root, "second")
        second = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
        assert "driven by another live controller" in second.stderr
        # Then a resume from another host takes the queue while this run's host is frozen (a real frozen host and
        # JuiceFS client: tests/integration/test_juicefs_fence.py). What this run's controller reads of that is the
        # new holder's record over its own, which its next refresh (every 10 s) finds. The record says its holder
        # is long silent, so that the resume below may take the fence once this run is gone.
        other = json.dumps({"host": "another-host", "pid": 7, "pid_start": 1.0, "since": time.time(), "alive_at": 0})
        with open(lock, "w") as f:
            f.write(other)
        assert first.wait(timeout=120) == 1, job.last_log()[-3000:]
        log = job.last_log()
        said = f"vime train: error: the queue in {job.data_dir} was taken by another controller ({other})"
        assert said in log and "Traceback" not in log, log[-3000:]
        with open(lock) as f:
            assert f.read() == other  # never rewritten by this run
    finally:
        job.kill(first)
    code, log = job.run(epochs=4)  # --load: the queue as a crash of the run would have left it
    assert code == 0, log[-3000:]
    check_invariants(job, epochs=4)


def last_step(log: str) -> int:
    """The last training step the run's log reports (0 before the first)."""
    steps = re.findall(r"^step +(\d+)/", log, re.MULTILINE)
    return int(steps[-1]) if steps else 0


@ON_JUICEFS
def test_whole_job_killed_at_random_instants(job):
    # Each kill lands at a random instant of training, whatever the machine's speed: once the run has
    # reported a random step, plus up to 0.1 s (a kill timed from the start lands in the start-up, 10-30 s,
    # which outlasts all 12 steps: 0.07-0.8 s each, on an idle or a loaded machine). After a first kill
    # that found no checkpoint, the next also waits for one, so that the invariants are checked on a
    # killed run at least once.
    rng = random.Random(int(os.environ.get("VIME_FAULT_SEED", "7")))
    latest = os.path.join(job.save, "latest_checkpointed_iteration.txt")
    kills = checked = 0
    for _ in range(2):  # each try costs a start-up: two keep the test's old runtime
        proc = job.start()
        target, offset = rng.randint(1, NUM_PROMPTS // 2 - 1), rng.uniform(0.0, 0.1)
        deadline = time.monotonic() + 300
        while proc.poll() is None and (
            last_step(job.last_log()) < target or (kills and not checked and not os.path.exists(latest))
        ):
            assert time.monotonic() < deadline, job.last_log()[-2000:]
            time.sleep(0.05)
        time.sleep(offset)
        finished = proc.poll() is not None
        job.kill(proc)
        if finished:
            break
        kills += 1
        if os.path.exists(latest):
            checked += 1
            check_invariants(job, complete=False)
    assert kills >= 1 and checked >= 1, (kills, checked)  # a kill mid-run found a checkpoint
    code, log = job.run()
    assert code == 0, log[-3000:]
    check_invariants(job)
    # The user's view of the same facts: `vime queue inspect --json` on the killed-and-resumed run.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime.cli",
            "queue",
            "inspect",
            "--rollout-data-dir",
            job.data_dir,
            "--save",
            job.save,
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    trained = report["trained_groups"]
    assert sorted(g["prompt_index"] for g in trained) == list(range(NUM_PROMPTS))
    assert [g["step"] for g in trained] == sorted(g["step"] for g in trained) and trained[-1]["step"] == 12
    assert all(g["n_samples"] == 2 and g["min_weight_version"] <= g["max_weight_version"] for g in trained)
    assert report["counts"]["trained"] == NUM_PROMPTS and report["counts"]["accepted"] == 0


@ON_JUICEFS
def test_a_corrupted_accepted_group_stops_the_run_naming_it(job):
    code, log = job.run("--num-rollout", "4")
    assert code == 0, log[-3000:]
    from vime.queue.journal_view import JournalView
    from vime.recovery import checkpoint as ckpt

    _, state = ckpt.load_state(job.save)
    untrained = [g for g in JournalView.read(job.data_dir).accepted() if g.position >= state.consumer_cursor]
    assert untrained, "the look-ahead left no accepted-but-untrained group"
    victim = untrained[0]
    pack = os.path.join(job.data_dir, victim.ref.manifest.segment.path)
    with open(pack, "r+b") as f:  # flip one byte inside the group's payload
        f.seek(victim.ref.manifest.segment.offset + 64)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, log = job.run("--num-rollout", "8")
    assert code == 1, log[-3000:]
    assert f"accepted group {victim.task_id} (queue position {victim.position}) cannot be read" in log
    assert "Traceback" not in log


def test_groups_older_than_max_staleness_are_never_trained(job):
    stale_plugin = os.path.join(REPO, "tests", "plugins", "stale_rollout.py") + ":generate_rollout"
    args = job.args("--max-staleness", "1")
    args[args.index("--rollout-function-path") + 1] = stale_plugin
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    facts = check_invariants(job)  # every prompt still trained exactly once
    assert facts["state"].skipped, "no group was stale"
    report = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "vime.cli",
                "queue",
                "inspect",
                "--rollout-data-dir",
                job.data_dir,
                "--save",
                job.save,
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    for group in report["trained_groups"]:
        policy = group["step"] - 1  # step s trains the weights of version s - 1
        assert policy - group["min_weight_version"] <= 1, group
    assert report["counts"]["rejected"] == len(facts["state"].skipped)
    records = [json.loads(line) for line in open(os.path.join(job.run_dir, "metrics.jsonl"))]
    assert sum(r.get("groups_regenerated", 0) for r in records) == len(facts["state"].skipped)


def _train_records(job) -> list[dict]:
    """The `train` records of metrics.jsonl, of every run on the job's --run-dir so far, in order."""
    with open(os.path.join(job.run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]
