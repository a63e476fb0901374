"""Disk space on the real stack (issue 23): an unwritable directory is refused before anything starts, and a run
whose queue volume is below --min-free-disk-gb says so in its progress output and records the free space."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import psutil
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left, vime_args
from tests.tmpfs import mounted_tmpfs
from vime.metrics import read_metrics

pytestmark = pytest.mark.e2e


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in psutil.process_iter():
        try:
            if any(text in part for part in proc.cmdline()):
                found.append(" ".join(proc.cmdline()[:4]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.parametrize("flag", ["--save", "--rollout-data-dir"])
def test_an_unwritable_directory_is_refused_before_anything_starts(tmp_path, tiny_model_dir, flag):
    run_dir = str(tmp_path / "run")
    with mounted_tmpfs(str(tmp_path / "ro"), size="1m", read_only=True) as ro:
        args = vime_args(tiny_model_dir, run_dir, "--num-rollout", "2")
        if flag == "--save":
            args += ["--save", f"{ro}/save"]
            expect = f"vime train: error: --save {ro}/save: cannot be created in {ro} (Read-only file system)\n"
        else:
            args[args.index("--rollout-data-dir") + 1] = ro
            expect = f"vime train: error: --rollout-data-dir {ro}: not writable (Read-only file system)\n"
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == expect  # one line: no traceback, nothing else said
    # Nothing started: no run directory (the run makes it first, its reaper logs there), no process of the run.
    assert not os.path.exists(run_dir)
    assert processes_mentioning(str(tmp_path)) == []


def test_low_disk_space_is_said_once_and_the_free_space_recorded(tmp_path, tiny_model_dir, vllm_engine):
    run_dir = str(tmp_path / "run")
    with mounted_tmpfs(str(tmp_path / "queue_volume"), size="64m") as volume:
        queue = os.path.join(volume, "rollout_data")
        # Just above the queue volume's free space; the weights (in the run dir, on another volume) have room.
        threshold = f"{(shutil.disk_usage(volume).free + 2**20) / 1e9:.6f}"
        with attached(vllm_engine) as engine_flags:
            args = vime_args(tiny_model_dir, run_dir, "--num-rollout", "2", *engine_flags)
            args[args.index("--rollout-data-dir") + 1] = queue
            args += ["--min-free-disk-gb", threshold]
            result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert_nothing_left(run_dir)
    warnings = [line for line in result.stdout.splitlines() if "low disk space" in line]
    assert len(warnings) == 1, result.stdout  # once per crossing: the queue stays below the threshold
    assert re.match(
        rf"\[vime\] low disk space: 0\.0\d GB free on the volume of --rollout-data-dir {re.escape(queue)}, "
        rf"below --min-free-disk-gb {float(threshold):g}; ",
        warnings[0],
    ), warnings[0]
    assert "What would help: --rollout-queue-online-gc" in warnings[0] and "a bigger volume" in warnings[0]
    train = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]
    assert len(train) == 2
    for record in train:
        assert 0 < record["disk_free_gb/queue"] < float(threshold)
        assert record["disk_free_gb/weights"] > float(threshold)
        assert "disk_bytes_per_step/queue" in record and "disk_free_gb/checkpoint" not in record  # no --save
    assert train[-1]["disk_bytes_per_step/queue"] > 0  # the queue's groups and journal, on a volume of its own


def test_a_queue_volume_that_fills_mid_run_stops_it_clearly_and_load_resumes_once_space_is_freed(
    tmp_path, tiny_model_dir, vllm_engine
):
    """Issue 23, point 3: the queue's volume fills after the first trained step (a ballast file takes what is
    left). The run stops with one line naming --rollout-data-dir and the operation, no traceback; once the
    ballast is gone, --load finishes the epoch and `vime queue inspect --json` shows every prompt trained once."""
    import json
    import sys
    import time

    from tests.e2e.test_kill_resume import NUM_PROMPTS
    from tests.e2e.test_main_job import EXAMPLE
    from tests.unit.test_disk_full import fill

    prompts = tmp_path / "prompts.jsonl"
    with open(os.path.join(EXAMPLE, "train.jsonl")) as f:
        prompts.write_text("".join(f.readlines()[:NUM_PROMPTS]))
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    with mounted_tmpfs(str(tmp_path / "queue_volume"), size="64m") as volume:
        queue = os.path.join(volume, "rollout_data")
        with attached(vllm_engine) as engine_flags:
            args = vime_args(
                tiny_model_dir,
                run_dir,
                *("--num-rollout", "1000", "--num-epoch", "1", "--no-save-hf", *engine_flags),
                *("--save", save, "--save-interval", "1", "--load", save, "--min-free-disk-gb", "0"),
            )
            args[args.index("--rollout-data-dir") + 1] = queue
            args[args.index("--prompt-data") + 1] = str(prompts)
            args[args.index("--rollout-batch-size") + 1] = "4"
            stderr = open(tmp_path / "stderr.txt", "w+")  # a file: a pipe nobody reads while waiting could fill
            proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
            ballast = None
            try:
                deadline = time.monotonic() + 400
                for line in proc.stdout:  # the progress line of the first step: then the volume fills
                    if line.startswith("step    1/"):
                        ballast = fill(volume)
                        break
                    assert time.monotonic() < deadline
                out, _ = proc.communicate(timeout=300)
            finally:
                if proc.poll() is None:
                    proc.kill()
                stderr.close()
            err = (tmp_path / "stderr.txt").read_text()
            assert ballast is not None, "the run never trained its first step"
            assert proc.returncode == 1, out[-3000:] + err[-3000:]
            said = err.strip().splitlines()[-1]
            assert said.startswith(f"vime train: error: the volume of --rollout-data-dir {queue} is full: "), err
            assert f"resume with --load {save}" in said and "Traceback" not in err, err
            assert_nothing_left(run_dir)
            os.unlink(ballast)  # space is freed
            result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "resuming from" in result.stdout
        report = subprocess.run(
            [
                sys.executable,
                "-m",
                "vime.cli",
                "queue",
                "inspect",
                "--rollout-data-dir",
                queue,
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
    assert sorted(g["prompt_index"] for g in trained) == list(range(NUM_PROMPTS))  # none lost, none twice
    assert trained[-1]["step"] == NUM_PROMPTS // 4
