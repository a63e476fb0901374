"""``vime queue``: look into a run's durable queue (read-only), reclaim its storage, retry its failures.

    vime queue inspect --rollout-data-dir D [--save S] [--json]
    vime queue gc --rollout-data-dir D
    vime queue export --rollout-data-dir D [--save S] [--format jsonl|parquet] [--hf-checkpoint H] OUT
    vime queue retry-failed --rollout-data-dir D | --run RUN_DIR [--json]

``inspect`` replays the queue's journal without writing to it, so it is safe on a live run. Groups
count as trained when they lie before the surviving lineage's cursor: the latest checkpoint in
``--save`` if given, else the queue's own committed cursor. Failed tasks are listed with their
last failure reason. The ledger (tools/ledger.py) accounts for every generated group, whole run
and per lineage: generated = trained + waiting + discarded by cause, and says whether it closes.

``export`` writes one row per sample of every accepted group (same lineage rule: ``stage`` is
trained, stale or accepted), with the token ids, reward, per-token weight versions, metadata,
source name, group position and, with ``--hf-checkpoint``, the decoded prompt and response.

``retry-failed`` returns every failed task (its attempts spent) to the queue as a fresh prompt with
a new attempt budget; rejected tasks (the dynamic filter's verdict) stay terminal. On a stopped run
``--rollout-data-dir D`` opens the queue itself, under the queue's fence (refused while a run drives
it); on a live run ``--run RUN_DIR`` asks the run's controller. A second call retries nothing.
Exit status: 0 done, 1 refused (a live run's queue; a run not live or not reachable), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from vime.errors import UserError
from vime.queue.journal_view import JournalView
from vime.queue.tasks import (
    INTERRUPTION_ATTEMPTS,
    LEASE_EXPIRED,
    LEASE_REVOKED,
    REJECTED_PREFIX,
    SAMPLE_ATTEMPTS,
    RetryReport,
    retry_id,
)
from vime.tools import ledger

# retried: a failed task whose retry (a fresh task for the same prompt) has been submitted
STAGES = ("fresh", "leased", "continuation", "accepted", "trained", "rejected", "failed", "retried")
FAILED_SHOWN = 20  # failed tasks the text output of `inspect` lists (--json lists them all)


@dataclasses.dataclass
class TaskState:
    """A task as the journal tells it: its stage, and how its attempts failed."""

    metadata: dict[str, Any]
    straw_attempts: int  # straw's budget for the task (ended attempts of any kind)
    stage: str = "fresh"
    partial: bool = False  # carries a durable prefix (a continuation)
    failures: int = 0  # attempts spent (see task_states)
    ended: int = 0  # ended attempts of any kind, as straw counts them against straw_attempts
    reason: str = ""  # the last failure reason ("" when every failure was a revoked lease)

    @property
    def counts_interruptions(self) -> bool:
        """Whether interrupted attempts spend the task's attempts: only for tasks submitted before vime
        stopped counting them (straw's default budget in the journal)."""
        return self.straw_attempts < INTERRUPTION_ATTEMPTS

    @property
    def max_attempts(self) -> int:
        return self.straw_attempts if self.counts_interruptions else SAMPLE_ATTEMPTS


def task_states(view: JournalView) -> dict[str, TaskState]:
    """The current state of every task, replayed from the journal: a failed call (a failure of the
    sample) spends one attempt; an expired lease or one revoked by a controller restart spends none
    (one each for tasks a journal submitted with straw's default budget, as vime counted them then);
    a released or yielded task none. The task ends failed when the failed call says so (vime fails
    the last attempt, and a rejection, as non-retryable) or when straw's budget of ended attempts of
    any kind is spent."""
    states: dict[str, TaskState] = {}

    def of(task_id: str) -> TaskState:  # a task the journal names before its submission: none expected
        return states.setdefault(task_id, TaskState({}, INTERRUPTION_ATTEMPTS))

    def end_attempt(task_id: str, reason: str | None, *, final: bool | None = None, interrupted: bool = False) -> None:
        state = of(task_id)
        state.reason = state.reason if reason is None else reason
        state.ended += 1
        if not interrupted or state.counts_interruptions:
            state.failures += 1
        if final is None:
            final = state.ended >= state.straw_attempts
        if final:
            state.stage = "rejected" if state.reason.startswith(REJECTED_PREFIX) else "failed"
        else:
            state.stage = "continuation" if state.partial else "fresh"

    for event in view.events:
        kind = event.get("type")
        if kind == "Submitted":
            for task in event["tasks"]:
                states[task["task_id"]] = TaskState(
                    task.get("metadata") or {}, task.get("max_attempts", 3), partial=task.get("input_ref") is not None
                )
        elif kind == "Leased":
            for lease in event["leases"]:
                of(lease["task_id"]).stage = "leased"
        elif kind == "Completed":
            of(event["lease"]["task_id"]).stage = "accepted"
        elif kind == "Yielded":
            state = of(event["task_id"])
            state.partial = state.partial or event.get("input_ref") is not None
            state.stage = "continuation" if state.partial else "fresh"
        elif kind == "Failed":
            for task_id in event["task_ids"]:
                end_attempt(task_id, str(event.get("failure", "")), final=event.get("response") == "failed")
        elif kind in ("Expired", "Epoch"):
            for task_id in event.get("task_ids") or event.get("revoked") or []:
                if task_id in states and states[task_id].stage == "leased":
                    end_attempt(task_id, LEASE_EXPIRED if kind == "Expired" else None, interrupted=True)
    for task_id, state in states.items():
        if state.stage == "failed" and retry_id(task_id) in states:
            state.stage = "retried"
    return states


def task_stages(view: JournalView) -> dict[str, str]:
    """The current stage of every task, replayed from the journal."""
    return {task_id: state.stage for task_id, state in task_states(view).items()}


def failed_tasks(states: dict[str, TaskState]) -> list[dict[str, Any]]:
    """The failed tasks not retried yet, in submission order, with their last failure reason."""
    failed = [(task_id, s) for task_id, s in states.items() if s.stage == "failed"]
    failed.sort(key=lambda item: (item[1].metadata.get("group_index", 0), item[0]))
    return [
        {
            "task_id": task_id,
            "prompt_index": s.metadata.get("prompt_index"),
            "group_index": s.metadata.get("group_index"),
            "epoch": s.metadata.get("epoch"),
            "attempts": s.failures,
            "max_attempts": s.max_attempts,
            "reason": s.reason or LEASE_REVOKED,
        }
        for task_id, s in failed
    ]


def lineage(data_dir: str, save: str | None, view: JournalView, run_id: str) -> tuple[int, list[int], set[int], str]:
    """(trained cursor, cursor after each step, positions skipped as stale, where it came from)."""
    survivor = ledger.surviving_lineage(data_dir, save, view, run_id)
    return survivor.cursor, survivor.step_cursors, set(survivor.skipped), survivor.source


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def inspect(data_dir: str, save: str | None, run_id: str) -> dict[str, Any]:
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    view = JournalView.read(data_dir)
    states = task_states(view)
    survivor = ledger.surviving_lineage(data_dir, save, view, run_id)
    cursor, step_cursors, skipped, source = (
        survivor.cursor,
        survivor.step_cursors,
        set(survivor.skipped),
        survivor.source,
    )
    accepted = view.accepted()
    counts = {name: 0 for name in STAGES}
    for state in states.values():
        counts[state.stage] += 1
    passed = [g for g in accepted if g.position < cursor]
    counts["accepted"] -= len(passed)
    counts["trained"] = sum(g.position not in skipped for g in passed)
    counts["rejected"] += sum(g.position in skipped for g in passed)  # too stale: prompt regenerated
    transport = StrawTransport(StoreOptions(data_dir, run_id))
    # Who wrote each accepted group's payload: the lease it was accepted under, "<rollout worker>@<straw writer>"
    # (a rollout worker leases under its own straw writer's id, and only that writer publishes its groups).
    written_by = {e["receipt"]["position"]: e["lease"]["worker_id"] for e in view.of_type("Completed")}
    groups = []
    for group in accepted:
        if group.position >= cursor:
            break
        if group.position in skipped:
            continue
        step = next((i + 1 for i, c in enumerate(step_cursors) if group.position < c), None)
        entry: dict[str, Any] = {
            "step": step,
            "position": group.position,
            "task_id": group.task_id,
            "written_by": written_by.get(group.position),
            "pack": group.ref.manifest.segment.path,  # relative to --rollout-data-dir
        }
        try:
            samples = transport.read(group.ref)
        except Exception as error:  # noqa: BLE001 - reclaimed by GC or unreadable: report, do not fail the listing
            entry.update(readable=False, error=f"{type(error).__name__}: {error}")
        else:
            versions = [v for s in samples for v in s.weight_versions]
            entry.update(
                readable=True,
                prompt_index=samples[0].prompt_index,
                group_index=samples[0].group_index,
                n_samples=len(samples),
                min_weight_version=min(versions, default=None),
                max_weight_version=max(versions, default=None),
                reward_mean=sum(s.reward or 0.0 for s in samples) / len(samples),
            )
        groups.append(entry)
    try:
        books = ledger.compute(
            view, {task_id: s.stage for task_id, s in states.items()}, survivor, transport.store, data_dir=data_dir
        )
    finally:
        transport.close()
    return {
        "rollout_data_dir": data_dir,
        "lineage": source,
        "trained_cursor": cursor,
        "counts": counts,
        "disk_bytes": disk_bytes(data_dir),
        "failed_tasks": failed_tasks(states),
        "trained_groups": groups,
        "ledger": books,
    }


def format_inspect(report: dict[str, Any]) -> str:
    lines = [
        f"queue {report['rollout_data_dir']}  ({report['disk_bytes'] / 2**20:.1f} MiB on disk)",
        "  " + "  ".join(f"{k} {v}" for k, v in report["counts"].items()),
        f"  trained in the surviving lineage: {len(report['trained_groups'])} group(s) ({report['lineage']})",
    ]
    failed = report["failed_tasks"]
    if failed:
        lines.append(
            f"  failed: {len(failed)} task(s), attempts spent (return them to the queue with "
            "`vime queue retry-failed`):"
        )
        for task in failed[:FAILED_SHOWN]:
            reason = " ".join(task["reason"].split())
            reason = reason if len(reason) <= 100 else reason[:97] + "..."
            lines.append(
                f"    {task['task_id']}  prompt {task['prompt_index']}  "
                f"{task['attempts']}/{task['max_attempts']} attempts  {reason}"
            )
        if len(failed) > FAILED_SHOWN:
            lines.append(f"    ... and {len(failed) - FAILED_SHOWN} more (--json lists them all)")
    return "\n".join(lines + ledger.format_ledger(report["ledger"]))


# ----------------------------------------------------------------------------- retry-failed
class RetryRefused(UserError, RuntimeError):
    """The retry cannot be done as asked (the message names the flag and says why)."""


def retry_failed_stopped(data_dir: str, run_id: str, declaration: dict | None = None) -> RetryReport:
    """Retry the failed tasks of a stopped run's queue: under the queue's fence, so never beside a
    live controller. Opening the queue recovers it, as a resumed run would (leases of the dead
    run are revoked, as on any restart; that spends none of their attempts)."""
    from vime.queue.fence import QueueBusy, QueueFence
    from vime.queue.juicefs_mount import checked_declaration
    from vime.queue.rollout_queue import StoreOptions, StrawRolloutQueue

    try:
        fence = QueueFence.acquire(data_dir)
    except QueueBusy:
        with open(os.path.join(data_dir, "controller.lock")) as f:
            holder = f.read().strip() or "unknown"
        raise RetryRefused(
            f"--rollout-data-dir {data_dir}: a live run drives this queue (its controller: {holder}); "
            "use `vime queue retry-failed --run RUN_DIR` on the live run, or stop it first"
        ) from None
    try:
        with open(os.path.join(data_dir, "run.json")) as f:
            identity = json.load(f)
        profile = identity.get("profile", "local")
        if profile == "juicefs":  # the mount is read and checked, as `vime train` does (queue/juicefs_mount.py)
            declaration = checked_declaration(data_dir, declaration)
        options = StoreOptions(data_dir, run_id, profile=profile, declaration=declaration)
        queue = StrawRolloutQueue.open(
            options, owner="vime-queue-retry-failed", lease_seconds=identity["lease_seconds"]
        )
        try:
            return queue.retry_failed()
        finally:
            queue.close()
    finally:
        fence.release()


def retry_failed_live(run_dir: str, timeout: float = 120.0) -> RetryReport:
    """Ask a live run's controller (a named Ray actor, workers/controller.py) to retry."""
    from vime.tools.engines_cli import EnginesCliError, attach

    try:
        namespace = attach(run_dir)
    except EnginesCliError as error:
        raise RetryRefused(f"--run {run_dir}: {error}") from None
    import ray

    from vime.workers.controller import Controller

    try:
        controller = ray.get_actor(Controller.ACTOR_NAME, namespace=namespace)
    except ValueError:
        raise RetryRefused(
            f"--run {run_dir}: the run has no controller reachable by name (still starting, or "
            "started by a vime without `retry-failed`); try again in a moment, or stop the run and "
            "use --rollout-data-dir"
        ) from None
    try:
        return ray.get(controller.retry_failed.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RetryRefused(f"--run {run_dir}: the controller did not answer within {timeout:g}s") from None
    except ray.exceptions.RayActorError:
        raise RetryRefused(f"--run {run_dir}: the run ended before its controller answered") from None


def abbreviate(values: list, shown: int = 10) -> str:
    text = ", ".join(str(v) for v in values[:shown])
    return text + (f", ... ({len(values) - shown} more)" if len(values) > shown else "")


def format_retry(report: RetryReport, live: bool) -> str:
    rejected = f"; {report.rejected} rejected task(s) stay rejected" if report.rejected else ""
    if not report.retried:
        return f"no failed task to retry{rejected}"
    prompts = [task.prompt_index for _, task in report.retried]
    when = "the run leases them like any fresh prompt" if live else "they run when the run resumes (--load)"
    return (
        f"retried {len(report.retried)} failed task(s) as fresh prompts with a new attempt budget "
        f"(prompt indices {abbreviate(prompts)}); {when}{rejected}"
    )


# ----------------------------------------------------------------------------- export
# One row per sample of every accepted group, in acceptance order. ``stage``: trained (before the
# surviving lineage's cursor), stale (passed over as too stale; its prompt was regenerated) or
# accepted (waiting for the trainer). Optional captures are {dtype, shape, data (flat)}.
# EXPORT_TENSORS is queue/records.py's OPTIONAL_TENSORS (not imported: `vime queue` stays torch-free
# until it needs torch; tests/unit/test_debug_replay.py keeps the two equal).
def main(argv: list[str] | None = None) -> int:
    paragraphs = __doc__.replace("``", "").split("\n\n")
    parser = argparse.ArgumentParser(
        prog="vime queue",
        description="\n\n".join(paragraphs[:2]),
        epilog=paragraphs[4] + "\n\nvime queue COMMAND -h shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        (
            "inspect",
            "counts per stage, disk use, the trained groups, the failed tasks and why, and the "
            "ledger of every generated group (does it close?)",
        ),
        ("gc", "reclaim storage nothing references any more (stopped runs only)"),
        ("export", "every accepted sample as jsonl or parquet, for analysis"),
        (
            "retry-failed",
            "return every failed task (not the rejected ones) to the queue as a fresh prompt with a new attempt budget",
        ),
    ):
        command = sub.add_parser(name, help=text, description=text)
        if name == "retry-failed":
            where = command.add_mutually_exclusive_group(required=True)
            where.add_argument(
                "--rollout-data-dir", help="a stopped run's queue directory (refused while a run drives it)"
            )
            where.add_argument("--run", metavar="RUN_DIR", help="a live run's --run-dir: its controller retries")
            command.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            command.add_argument("--rollout-data-dir", required=True, help="the run's queue directory")
        command.add_argument("--rollout-queue-run-id", default="vime", help="queue identity (default: vime)")
        if name in ("gc", "retry-failed"):
            command.add_argument(
                "--rollout-storage-declaration",
                help="JSON (inline or @file) of a JuiceFS mount; default: read from the mount (docs/juicefs.md)",
            )
        if name == "inspect":
            command.add_argument("--save", help="checkpoint directory: its latest checkpoint defines the lineage")
            command.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "export":
            command.add_argument("--save", help="checkpoint directory: its latest checkpoint defines the lineage")
            command.add_argument(
                "--format", choices=["jsonl", "parquet"], help="output format (default: from OUT's extension)"
            )
            command.add_argument("--hf-checkpoint", help="decode prompts and responses with this model's tokenizer")
            command.add_argument("out", metavar="OUT", help="the file to write")
    args = parser.parse_args(argv)
    if args.command == "retry-failed" and args.run:
        if not os.path.isdir(args.run):
            print(f"vime queue retry-failed: error: --run {os.path.abspath(args.run)} does not exist", file=sys.stderr)
            return 2
        return _retry_failed(args, live=True)
    data_dir = os.path.abspath(args.rollout_data_dir)
    if not os.path.isdir(data_dir):
        print(f"vime queue {args.command}: error: --rollout-data-dir {data_dir} does not exist", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(data_dir, "run.json")):
        print(f"vime queue {args.command}: error: --rollout-data-dir {data_dir} holds no queue", file=sys.stderr)
        return 2
    if args.command == "retry-failed":
        return _retry_failed(args, live=False, data_dir=data_dir)
    if args.command == "export":
        fmt = args.format or {".jsonl": "jsonl", ".parquet": "parquet"}.get(os.path.splitext(args.out)[1])
        if fmt is None:
            print(
                f"vime queue: error: --format: give jsonl or parquet (OUT {args.out!r} has neither extension)",
                file=sys.stderr,
            )
            return 2
        from vime.tools.queue_export import export  # pyarrow and torch: only for this command

        report = export(data_dir, args.save, args.rollout_queue_run_id, args.out, fmt, args.hf_checkpoint)
        print(
            f"exported {report['samples']} sample(s) of {report['groups']} accepted group(s) "
            f"({report['trained']} trained, {report['accepted']} waiting, {report['stale']} stale; "
            f"{report['unreadable']} unreadable) to {args.out}"
        )
        return 0
    if args.command == "gc":
        from vime.queue.gc import collect_stopped
        from vime.queue.juicefs_mount import JuiceFSMountRefused

        try:
            report = collect_stopped(data_dir, args.rollout_queue_run_id, _declaration(args))
        except JuiceFSMountRefused as error:
            print(f"vime queue gc: error: {error}", file=sys.stderr)
            return 1
        print(json.dumps(report, indent=1))
        return 0
    report = inspect(data_dir, args.save, args.rollout_queue_run_id)
    print(json.dumps(report, indent=1) if args.json else format_inspect(report))
    return 0


def _declaration(args) -> dict | None:
    from vime.config.framework import QueueConfig

    return QueueConfig(rollout_storage_declaration=args.rollout_storage_declaration).storage_declaration()


def _retry_failed(args, *, live: bool, data_dir: str | None = None) -> int:
    from vime.queue.juicefs_mount import JuiceFSMountRefused

    try:
        if live:
            report = retry_failed_live(os.path.abspath(args.run))
        else:
            report = retry_failed_stopped(data_dir, args.rollout_queue_run_id, _declaration(args))
    except (RetryRefused, JuiceFSMountRefused) as error:
        print(f"vime queue retry-failed: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "retried": [
                        {
                            "task_id": old,
                            "retry_task_id": new.task_id,
                            "prompt_index": new.prompt_index,
                            "epoch": new.epoch,
                        }
                        for old, new in report.retried
                    ],
                    "rejected": report.rejected,
                },
                indent=1,
            )
        )
    else:
        print(format_retry(report, live))
    return 0


if __name__ == "__main__":
    sys.exit(main())
