"""Read back what vime's trackers wrote, with each tracker's own reader: wandb's `wandb leet inspect --json`
(its reader of the offline run's .wandb transaction log) and TensorBoard's EventAccumulator."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

WANDB = os.path.join(os.path.dirname(sys.executable), "wandb")


def wandb_records(run_file: str) -> list[dict]:
    result = subprocess.run(
        [WANDB, "leet", "inspect", run_file, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def wandb_offline_runs(wandb_dir: str) -> list[list[dict]]:
    """The records of every offline run (one per process that logged) under ``wandb_dir``, oldest first."""
    runs = []
    for run_file in glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")):
        records = wandb_records(run_file)
        started = next(r["run"]["start_time"] for r in records if r["type"] == "run")
        runs.append((started, records))
    return [records for _, records in sorted(runs, key=lambda item: item[0])]


def wandb_history(wandb_dir: str) -> list[tuple[str, int, dict]]:
    """(run id, step, values) of every history row of every offline run, in the order they were written."""
    rows = []
    for records in wandb_offline_runs(wandb_dir):
        run_id = next(r["run"]["run_id"] for r in records if r["type"] == "run")
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                rows.append((run_id, int(item["_step"]), {k: v for k, v in item.items() if not k.startswith("_")}))
    return rows


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in the order written, across every event file of ``log_dir``. Purging is off,
    so that a step written twice (or a step going backwards) shows up instead of being hidden."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_one_monotone_axis(steps: list[int], what: str) -> None:
    assert steps == sorted(set(steps)), f"{what}: steps not strictly increasing (duplicated or backwards): {steps}"
