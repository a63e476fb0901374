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
