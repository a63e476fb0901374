"""Reclaiming queue storage: orphaned publications of dead producers, and packs nobody owns.

A rollout worker publishes a group's payload (durable) and then asks the controller to accept it.
If it dies in between, straw keeps the payload's pack alive under the writer's staging ownership.
Rollout workers lease under the id ``<name>@<straw writer id>``, so from the journal alone one can
find every attempt a dead writer held; its staged publications are looked up by their
deterministic submission ids and released. Accepted groups and continuations are owned by the
queue as well, so releasing their staging frees nothing that is still needed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict

from straw.errors import StorageUnavailable, UnsafeRecovery, WriterBusy

from vime.queue.journal_view import JournalView

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class Attempt:
    at: int  # the index of its Leased event in the journal
    task_id: str
    attempt_id: str

    @property
    def key(self) -> tuple[str, str]:
        return self.task_id, self.attempt_id


@dataclasses.dataclass(frozen=True)
class WriterPublications:
    """What the journal says about the producers' publications: each writer's attempts, which of them were
    accepted (and when), and which payloads the queue adopted (accepted groups, continuation prefixes).

    A rollout worker publishes several finished groups at a time (workers/group_publisher.py) under the
    submission id of the first one (queue/transport.py ``publication_id``), so a group the queue never accepted
    is found under its own attempt's id when it led its publication, and otherwise under the id of the group that
    led it, one this writer leased and then published with it. That leader, if accepted, was accepted after the
    group was leased."""

    attempts: dict[str, list[Attempt]]
    accepted_at: dict[tuple[str, str], int]  # attempt -> the index of its Completed event
    adopted: frozenset[str]  # digests
    continued: frozenset[tuple[str, str]] = frozenset()  # attempts that gave their task back with a prefix
    returned_at: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # ^ attempt -> the index of the call its worker ended it with (gave it back, with or without a prefix, or failed it)
    ended_at: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # ^ attempt -> the index of the event that ended it (the worker's call, the queue's), or of its task's next lease

    @classmethod
    def of(cls, view: JournalView) -> WriterPublications:
        attempts: dict[str, list[Attempt]] = defaultdict(list)
        accepted_at: dict[tuple[str, str], int] = {}
        adopted, continued = set(), set()
        returned_at: dict[tuple[str, str], int] = {}
        ended_at: dict[tuple[str, str], int] = {}
        current: dict[str, tuple[str, str]] = {}  # task -> its latest attempt (an ending event names the task only)

        def ended(task_id: str | None, at: int) -> tuple[str, str] | None:
            attempt = current.get(task_id)
            if attempt is not None:
                ended_at.setdefault(attempt, at)
            return attempt

        for at, event in enumerate(view.events):
            kind = event.get("type")
            if kind == "Leased":
                for lease in event["leases"]:
                    ended(lease["task_id"], at)  # a task is leased again once its attempt before has ended
                    current[lease["task_id"]] = (lease["task_id"], lease["attempt_id"])
                    writer = writer_of(lease["worker_id"])
                    if writer:
                        attempts[writer].append(Attempt(at, lease["task_id"], lease["attempt_id"]))
            elif kind == "Completed":
                accepted_at[(event["lease"]["task_id"], event["lease"]["attempt_id"])] = at
                adopted.add(event["receipt"]["result_ref"]["digest"])
            elif kind == "Yielded":  # return_partial: with the prefix it names, or untouched
                attempt = ended(event.get("task_id"), at)
                if attempt is not None:
                    returned_at[attempt] = at
                if event.get("input_ref"):
                    adopted.add(event["input_ref"]["digest"])
                    if attempt is not None:
                        continued.add(attempt)
            elif kind == "Failed":
                # A worker's fail or reject call carries its reason; the queue's own failures (the leases of a retired
                # worker) a category, and are not the worker's: it may have gone on with the group meanwhile.
                for task_id in event.get("task_ids", []):
                    attempt = ended(task_id, at)
                    if attempt is not None and isinstance(event.get("failure"), str):
                        returned_at[attempt] = at
            elif kind == "Epoch":  # a controller's restart revoked the leases in flight
                for task_id in event.get("revoked", []):
                    ended(task_id, at)
        return cls(dict(attempts), accepted_at, frozenset(adopted), frozenset(continued), returned_at, ended_at)

    def unadopted(
        self,
        store,
        writer: str,
        deadline: float,
        *,
        continuations: bool = True,
        still_on: frozenset = frozenset(),
        thorough: bool = True,
    ) -> list:
        """The publications of ``writer`` that the queue did not adopt (references, each once): its groups, and
        its continuation prefixes unless ``continuations`` is false. The attempts in ``still_on`` (a live run's
        leases) are not looked for, though a publication found for another may hold their groups. Raises WriterBusy
        when the writer's gate stays held past ``deadline`` (see publication_receipt).

        ``thorough=False`` (the reaping inside a run, which holds up the controller) looks only at what the writer's
        last calls may have left: not at an attempt whose lease the queue ended (a controller's restart, an expired
        lease) before the writer leased a group that was accepted. Such a group was let go by a worker that went on
        working; only one published in the moment between that and the worker's death is missed, and ``vime queue
        gc`` (thorough) finds it."""
        found = {}  # digest -> reference

        def look_up(submission: str) -> bool:
            refs = publication_receipt(store, writer, submission, deadline)
            found.update((ref.digest, ref) for ref in refs or [])
            return refs is not None

        # Each lookup reads the writer's whole record of publications (straw), so the attempts whose outcome is known
        # are not looked for: an accepted one's group and a continued one's prefix are the queue's, and neither
        # published anything else (a worker publishes either the whole group or, giving the task back, its prefix).
        # Nor is an attempt its worker ended itself (gave back untouched, or failed) before leasing a group that was
        # accepted: a worker gives up a payload whose hand-over call raised (workers/rollout_worker.py), and a
        # publication that failed is published again and given up before the worker's next one goes through
        # (queue/transport.py); the accepted group was published after that call. What is left is what the worker's
        # last calls may have left, and the attempts whose lease the queue ended (a retired worker's, an expired or
        # revoked lease) while the worker may have gone on with the group.
        attempts = self.attempts.get(writer, [])
        last_accepted_lease = max((a.at for a in attempts if a.key in self.accepted_at), default=-1)
        first_unfound = None  # the earliest lease of an attempt looked for and not found under its own id
        for attempt in attempts:  # in the order of their leases
            if attempt.key in still_on or attempt.key in self.accepted_at or attempt.key in self.continued:
                continue
            if self.returned_at.get(attempt.key, last_accepted_lease) < last_accepted_lease:
                continue
            if not thorough and self.ended_at.get(attempt.key, last_accepted_lease) < last_accepted_lease:
                continue
            if continuations:
                look_up(partial_submission_id(*attempt.key))
            if not look_up(group_submission_id(*attempt.key)):
                first_unfound = attempt.at if first_unfound is None else first_unfound
        if first_unfound is not None:
            # Published with a group accepted later, or never published (its writer died while generating it, or it
            # failed before): the leaders of the publications it could have joined.
            for attempt in attempts:
                if self.accepted_at.get(attempt.key, -1) > first_unfound:
                    look_up(group_submission_id(*attempt.key))
        return [ref for digest, ref in found.items() if digest not in self.adopted]


# vime's record of the dead writers already reaped, a line each: the writer's id and how (beside straw's own files in
# the queue's folder). A retired writer publishes nothing more, so what was released once stays released, and a later
# reap (every rollout worker's death asks for one) does not look up its publications again; a thorough one (`vime
# queue gc`) looks again at a writer the run's own reaping went through (see WriterPublications.unadopted).
REAPED_FILE = "reaped_writers"
THOROUGH, IN_RUN = "thorough", "in-run"


def reaped_writers(data_dir: str, *, thorough: bool = False) -> set[str]:
    """The writers a reap has finished with (only the thorough reaps' when ``thorough``). A line cut short by a crash
    names no writer, and that one is reaped again."""
    try:
        with open(os.path.join(data_dir, REAPED_FILE)) as f:
            lines = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return set()
    return {words[0] for words in lines if len(words) == 2 and (words[1] == THOROUGH or not thorough)}


def _mark_reaped(data_dir: str, writer: str, thorough: bool) -> None:
    """Record ``writer`` as reaped. Only a saving: where the record cannot be written (a full volume), the writer is
    reaped again next time, which releases nothing twice."""
    try:
        fd = os.open(os.path.join(data_dir, REAPED_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{writer} {THOROUGH if thorough else IN_RUN}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        logger.warning("could not record writer %s as reaped (%s); a later reap looks at it again", writer, error)


def reap_writers(store, data_dir: str, dead: list[str], *, thorough: bool = True) -> dict[str, int]:
    """Fence the given (dead) writers and release the publications the queue never adopted.

    A group publication is adopted when its attempt completed; a continuation prefix when a
    Yielded event names it as the task's input. A writer that is still busy raises WriterBusy
    inside straw and is skipped (a later reap, or ``vime queue gc``, retires it); so is one whose gate stays
    held past :data:`GATE_WAIT_SECONDS` after its retirement (``writers_busy``). A writer reaped before is
    skipped (``writers_reaped_before``; see REAPED_FILE). ``thorough``: see WriterPublications.unadopted.
    """
    done = reaped_writers(data_dir, thorough=thorough)
    before = len(dead)
    dead = [writer for writer in dead if writer not in done]
    publications = WriterPublications.of(JournalView.read(data_dir)) if dead else None  # None: nothing to look up
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
            orphans = publications.unadopted(store, writer, deadline, thorough=thorough)
        except WriterBusy:
            busy += 1
            continue
        if orphans:
            store.release_publications(orphans)
            released += len(orphans)
        _mark_reaped(data_dir, writer, thorough)
    return {
        "writers_retired": retired,
        "publications_released": released,
        "writers_never_started": unstarted,
        "writers_busy": busy,
        "writers_reaped_before": before - len(dead),
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
