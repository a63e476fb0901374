"""``vime queue``: look into a run's durable queue (read-only) and reclaim its storage.

    vime queue inspect --rollout-data-dir D [--save S] [--json]
    vime queue gc --rollout-data-dir D

``inspect`` replays the queue's journal without writing to it, so it is safe on a live run. Groups
count as trained when they lie before the surviving lineage's cursor: the latest checkpoint in
``--save`` if given, else the queue's own committed cursor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vime.queue.journal_view import JournalView

STAGES = ("fresh", "leased", "continuation", "accepted", "trained", "rejected", "failed")


def task_stages(view: JournalView) -> dict[str, str]:
    """The current stage of every task, replayed from the journal."""
    stage: dict[str, str] = {}
    partial: dict[str, bool] = {}
    for event in view.events:
        kind = event.get("type")
        if kind == "Submitted":
            for task in event["tasks"]:
                stage[task["task_id"]] = "fresh"
                partial[task["task_id"]] = task.get("input_ref") is not None
        elif kind == "Leased":
            for lease in event["leases"]:
                stage[lease["task_id"]] = "leased"
        elif kind == "Completed":
            stage[event["lease"]["task_id"]] = "accepted"
        elif kind == "Yielded":
            task_id = event["task_id"]
            if event.get("input_ref") is not None:
                partial[task_id] = True
            stage[task_id] = "continuation" if partial.get(task_id) else "fresh"
        elif kind == "Failed":
            final = event.get("response") == "failed"
            rejected = str(event.get("failure", "")).startswith("rejected:")
            for task_id in event["task_ids"]:
                if final:
                    stage[task_id] = "rejected" if rejected else "failed"
                else:
                    stage[task_id] = "continuation" if partial.get(task_id) else "fresh"
        elif kind in ("Expired", "Epoch"):
            for task_id in event.get("task_ids") or event.get("revoked") or []:
                if stage.get(task_id) == "leased":
                    stage[task_id] = "continuation" if partial.get(task_id) else "fresh"
    return stage


def lineage(data_dir: str, save: str | None, view: JournalView, run_id: str) -> tuple[int, list[int], str]:
    """(trained cursor, cursor after each step, where it came from)."""
    if save:
        from vime.recovery import checkpoint as ckpt

        if ckpt.latest_step(save) is not None:
            _, state = ckpt.load_state(save)
            return state.consumer_cursor, list(state.step_cursors), f"checkpoint step {state.step} in {save}"
    states = view.of_type("ConsumerState")
    if not states:
        return 0, [], "nothing trained"
    response = states[-1]["response"]
    from straw import RecordSetRef

    from vime.queue.rollout_queue import open_store

    store = open_store(data_dir, run_id)
    try:
        payload = json.loads(next(store.read(RecordSetRef.from_dict(response["state_ref"]))).payload)
    finally:
        store.close()
    return response["processed_cursor"], payload.get("step_cursors", []), "the queue's committed cursor"


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def inspect(data_dir: str, save: str | None, run_id: str) -> dict[str, Any]:
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    view = JournalView.read(data_dir)
    stages = task_stages(view)
    cursor, step_cursors, source = lineage(data_dir, save, view, run_id)
    accepted = view.accepted()
    counts = {name: 0 for name in STAGES}
    for value in stages.values():
        counts[value] += 1
    trained_ids = {g.task_id for g in accepted if g.position < cursor}
    counts["accepted"] -= len(trained_ids)
    counts["trained"] = len(trained_ids)
    transport = StrawTransport(StoreOptions(data_dir, run_id))
    groups = []
    for group in accepted:
        if group.position >= cursor:
            break
        step = next((i + 1 for i, c in enumerate(step_cursors) if group.position < c), None)
        entry: dict[str, Any] = {"step": step, "position": group.position, "task_id": group.task_id}
        try:
            samples = transport.read(group.ref)
        except Exception as error:  # reclaimed by GC or unreadable: report, do not fail the listing
            entry.update(readable=False, error=f"{type(error).__name__}: {error}")
        else:
            versions = [v for s in samples for v in s.weight_versions]
            entry.update(readable=True, prompt_index=samples[0].prompt_index, group_index=samples[0].group_index,
                         n_samples=len(samples), min_weight_version=min(versions, default=None),
                         max_weight_version=max(versions, default=None),
                         reward_mean=sum(s.reward or 0.0 for s in samples) / len(samples))
        groups.append(entry)
    transport.close()
    return {"rollout_data_dir": data_dir, "lineage": source, "trained_cursor": cursor, "counts": counts,
            "disk_bytes": disk_bytes(data_dir), "trained_groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vime queue", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("inspect", "counts per stage, disk use and the trained groups"),
                       ("gc", "reclaim storage nothing references any more (stopped runs only)")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--rollout-data-dir", required=True, help="the run's queue directory")
        command.add_argument("--rollout-queue-run-id", default="vime", help="queue identity (default: vime)")
        if name == "gc":
            command.add_argument("--rollout-storage-declaration", help="JSON (inline or @file) of a JuiceFS mount")
        if name == "inspect":
            command.add_argument("--save", help="checkpoint directory: its latest checkpoint defines the lineage")
            command.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    data_dir = os.path.abspath(args.rollout_data_dir)
    if not os.path.exists(os.path.join(data_dir, "run.json")):
        print(f"vime queue: error: --rollout-data-dir {data_dir} holds no queue", file=sys.stderr)
        return 2
    if args.command == "gc":
        from vime.queue.gc import collect_stopped

        from vime.config.framework import QueueConfig

        declaration = QueueConfig(rollout_storage_declaration=args.rollout_storage_declaration).storage_declaration()
        print(json.dumps(collect_stopped(data_dir, args.rollout_queue_run_id, declaration), indent=1))
        return 0
    report = inspect(data_dir, args.save, args.rollout_queue_run_id)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"queue {report['rollout_data_dir']}  ({report['disk_bytes'] / 2**20:.1f} MiB on disk)")
    print("  " + "  ".join(f"{k} {v}" for k, v in report["counts"].items()))
    print(f"  trained in the surviving lineage: {len(report['trained_groups'])} group(s) ({report['lineage']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
