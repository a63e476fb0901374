"""Reclaiming queue storage: orphaned publications of dead producers, and packs nobody owns.

A rollout worker publishes a group's payload (durable) and then asks the controller to accept it.
If it dies in between, straw keeps the payload's pack alive under the writer's staging ownership.
Rollout workers lease under the id ``<name>@<straw writer id>``, so from the journal alone one can
find every attempt a dead writer held; its staged publications are looked up by their
deterministic submission ids and released. Accepted groups and continuations are owned by the
queue as well, so releasing their staging frees nothing that is still needed.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

from straw.errors import StorageUnavailable, UnsafeRecovery, WriterBusy

from vime.queue.journal_view import JournalView


def group_submission_id(task_id: str, attempt_id: str) -> str:
    return f"{task_id}-{attempt_id}"


def partial_submission_id(task_id: str, attempt_id: str) -> str:
    return f"{task_id}-{attempt_id}-partial"


def writer_of(worker_id: str) -> str | None:
    return worker_id.rsplit("@", 1)[1] if "@" in worker_id else None


def writer_ids(data_dir: str) -> list[str]:
    root = os.path.join(data_dir, "control", "writers")
    if not os.path.isdir(root):
        return []
    return sorted(name for shard in os.listdir(root) for name in os.listdir(os.path.join(root, shard)))


def never_started(data_dir: str, writer: str) -> bool:
    """Whether ``writer`` died while straw was creating it, before its journal held its first transaction (its
    identity), so that it published nothing: its gate and control folder exist, and the journal is either not
    created yet (straw answers StorageUnavailable, "No such file or directory") or empty (UnsafeRecovery:
    "Journal run/configuration identity mismatch"). There is nothing to recover. Both were seen after a
    SIGKILL of the whole job at a random instant. Earlier still, the kill leaves the writer's folder with
    nothing in it (straw: "No registered writer gate"; seen in the same test). A writer created on a full
    volume gets further only to an empty gate file (its identity could not be written; straw: "Writer gate
    identity is missing, incomplete or mismatched") and no control folder: it published nothing either
    (tests/unit/test_disk_full.py)."""
    root = os.path.join(data_dir, "control", "writers", writer[:2], writer)
    control = os.path.join(root, "operations", "control")
    journal = os.path.join(control, "journal.log")
    if not os.path.isdir(control):
        gate = os.path.join(root, "gate")
        gate_unwritten = not os.path.lexists(gate) or (os.path.isfile(gate) and os.path.getsize(gate) == 0)
        return gate_unwritten and not os.path.lexists(os.path.join(root, "operations"))
    return not os.path.lexists(journal) or (os.path.isfile(journal) and os.path.getsize(journal) == 0)


def never_registered(data_dir: str, writer: str) -> bool:
    """Whether ``writer`` has no directory at all: straw creates it at the writer's first publication, so a
    producer killed after leasing but before publishing anything leaves none (and straw answers any
    question about it with UnsafeRecovery: "No registered writer gate")."""
    return not os.path.isdir(os.path.join(data_dir, "control", "writers", writer[:2], writer))


# How long one reap waits, in all, for dead writers' gates still held (see publication_receipt).
GATE_WAIT_SECONDS = 30.0


def publication_receipt(store, writer: str, submission: str, deadline: float, poll: float = 0.5):
    """straw's receipt of ``writer``'s publication ``submission``, waiting (until the monotonic ``deadline``)
    while straw answers WriterBusy. A SIGKILLed writer's mutation gate can stay held a moment after its
    retirement: seen on JuiceFS (tests/faults/test_fault_injection.py, a rollout worker killed mid-generation),
    whose client lets go of a killed process's lock later than a local file system does. Raises WriterBusy
    past the deadline."""
    while True:
        try:
            return store.publication_receipt(writer, api="publish", submission_id=submission)
        except WriterBusy:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll)


def attempts_by_writer(view: JournalView) -> dict[str, list[tuple[str, str]]]:
    attempts: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for event in view.of_type("Leased"):
        for lease in event["leases"]:
            writer = writer_of(lease["worker_id"])
            if writer:
                attempts[writer].append((lease["task_id"], lease["attempt_id"]))
    return attempts


def reap_writers(store, data_dir: str, dead: list[str]) -> dict[str, int]:
    """Fence the given (dead) writers and release the publications the queue never adopted.

    A group publication is adopted when its attempt completed; a continuation prefix when a
    Yielded event names it as the task's input. A writer that is still busy raises WriterBusy
    inside straw and is skipped (a later reap, or ``vime queue gc``, retires it); so is one whose gate stays
    held past :data:`GATE_WAIT_SECONDS` after its retirement (``writers_busy``).
    """
    view = JournalView.read(data_dir)
    attempts = attempts_by_writer(view)
    completed = {(e["lease"]["task_id"], e["lease"]["attempt_id"]) for e in view.of_type("Completed")}
    inputs = {e["input_ref"]["digest"] for e in view.of_type("Yielded") if e.get("input_ref")}
    retired = released = unstarted = busy = 0
    deadline = time.monotonic() + GATE_WAIT_SECONDS
    for writer in dead:
        try:
            store.retire_writer(writer, policy="recover")
        except WriterBusy:
            continue
        except (UnsafeRecovery, StorageUnavailable):
            if not never_started(data_dir, writer):
                raise
            unstarted += 1  # killed while it was being created (seen after a SIGKILL of the whole job)
            continue
        retired += 1
        try:
            for task_id, attempt_id in attempts.get(writer, []):
                candidates = [] if (task_id, attempt_id) in completed else [group_submission_id(task_id, attempt_id)]
                candidates.append(partial_submission_id(task_id, attempt_id))
                for submission in candidates:
                    refs = publication_receipt(store, writer, submission, deadline)
                    orphans = [r for r in refs or [] if r.digest not in inputs]
                    if orphans:
                        store.release_publications(orphans)
                        released += len(orphans)
        except WriterBusy:
            busy += 1
    return {
        "writers_retired": retired,
        "publications_released": released,
        "writers_never_started": unstarted,
        "writers_busy": busy,
    }


def collect_stopped(data_dir: str, run_id: str, declaration: dict | None = None) -> dict[str, int]:
    """GC of a stopped run: retire every writer, release orphans, reclaim unowned sealed packs."""
    import json

    from vime.queue.fence import QueueFence
    from vime.queue.juicefs_mount import checked_declaration
    from vime.queue.rollout_queue import StoreOptions, StrawRolloutQueue

    fence = QueueFence.acquire(data_dir)  # refuses while the run's controller is alive
    try:
        with open(os.path.join(data_dir, "run.json")) as f:
            identity = json.load(f)
        profile = identity.get("profile", "local")
        if profile == "juicefs":  # the mount is read and checked, as `vime train` does (queue/juicefs_mount.py)
            declaration = checked_declaration(data_dir, declaration)
        options = StoreOptions(data_dir, run_id, profile=profile, declaration=declaration)
        queue = StrawRolloutQueue.open(options, owner="vime-queue-gc", lease_seconds=identity["lease_seconds"])
        try:
            own = queue.store.writer_id
            report = reap_writers(queue.store, data_dir, [w for w in writer_ids(data_dir) if w != own])
            before = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(data_dir) for f in fs)
            queue.store.seal()
            gc = queue.coordinator.collect_garbage()
            report.update(
                reclaimed_files=gc.get("reclaimed_files", 0),
                reclaimed_bytes=gc.get("reclaimed_bytes", 0),
                disk_bytes_before=before,
            )
            return report
        finally:
            queue.close()
    finally:
        fence.release()
