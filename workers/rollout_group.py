"""The rollout workers of a run: one record per worker, and what happens when one dies.

A run has one rollout worker to begin with and one more for every node that joins the cluster
(docs/elastic.md). The driver calls :meth:`RolloutGroup.poll` while it waits for groups:

- a worker whose process died is **replaced**: its leases are fenced at once (its tasks return to the
  queue), a new worker starts in its place (on the same node, if it had one), and the dead worker's
  publications the trainer never accepted are released — up to ``max_restarts`` replacements per run;
- a worker whose node left the cluster is **dropped** (its leases are fenced too);
- a worker whose code returned or raised stops the run, with the worker's error: a bug, not a fault to
  heal, or the queue's volume found full (recovery/disk_full.py's DiskFull, which says how to resume).

:meth:`RolloutGroup.stop` ends generation at the end of a run (or at Ctrl-C): every worker is told to
stop, the engines abort the requests in flight (their groups go back to the queue as continuations),
and what each worker contributed is recorded.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from vime.errors import MemberDied

# A rollout worker's process imports vime, torch and transformers and loads the tokenizer before it opens
# its queue: seconds on an idle machine, over a minute on a loaded one (a node's worker was given up after
# 60 s while the machine ran another job).
WORKER_START_SECONDS = 300.0
MAX_WORKER_RESTARTS = 5


class RolloutWorkersLost(MemberDied, RuntimeError):
    """Rollout workers died more often than the run allows, or one stopped by itself; the driver stops the
    run naming it."""


class WorkerState(enum.Enum):
    CREATED = "created"  # the actor exists; its queue is not open yet (worker 0, created early)
    GENERATING = "generating"  # its queue is open and its run loop is going


@dataclasses.dataclass
class RolloutMember:
    """One rollout worker: its actor, its run loop's result, and its identities on the queue."""

    actor: Any
    node_id: str | None = None  # the node it was placed on (None: anywhere)
    state: WorkerState = WorkerState.CREATED
    run: Any = None  # the ObjectRef of its run loop, once generating
    writer_id: str | None = None  # its straw writer (its unaccepted publications are released if it dies)
    lease_id: str | None = None  # the id it leases under (fenced when it dies)


class RolloutGroup:
    """The run's rollout workers. ``make_actor(index, node_id)`` creates worker ``index``'s actor (the driver
    builds its spec from the settings); ``controller`` is the queue's controller actor; ``say`` and ``record``
    are the run's progress output and ``metrics.jsonl``."""

    def __init__(
        self,
        make_actor: Callable[[int, str | None], Any],
        controller,
        *,
        say: Callable[[str], None],
        record: Callable[[dict], None],
        start_seconds: float = WORKER_START_SECONDS,
        max_restarts: int = MAX_WORKER_RESTARTS,
    ):
        self.make_actor = make_actor
        self.controller = controller
        self.say = say
        self.record = record
        self.start_seconds = start_seconds
        self.max_restarts = max_restarts
        self.members: list[RolloutMember] = []
        self.restarts = 0

    def __len__(self) -> int:
        return len(self.members)

    @property
    def actors(self) -> list:
        return [m.actor for m in self.members if m.state is WorkerState.GENERATING]

    # ------------------------------------------------------------------ start
    def prepare(self) -> None:
        """Create worker 0's actor early: its process imports and loads while the rest of the run starts."""
        if not self.members:
            self.members.append(RolloutMember(self.make_actor(0, None)))

    def start(self) -> None:
        """Open worker 0's queue and start its run loop (raises if it cannot start)."""
        self.prepare()
        self._launch(self.members[0])

    def add_on_node(self, node_id: str) -> int | None:
        """A worker for a node that joined; returns its index, or None when it could not start there
        within ``start_seconds`` (the node's engines stay)."""
        member = RolloutMember(self.make_actor(len(self.members), node_id), node_id=node_id)
        self.members.append(member)
        if self._launch(member):
            return self.members.index(member)
        return None

    def _launch(self, member: RolloutMember) -> bool:
        """Open ``member``'s queue and start its run loop. A worker placed on a node that cannot start
        is given up (removed); one placed anywhere raises: the run cannot generate without it."""
        import ray

        try:
            identity = ray.get(member.actor.open_queue.remote(), timeout=self.start_seconds)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as error:
            if member.node_id is None:
                raise
            ray.kill(member.actor)
            self.say(
                f"rollout worker {self.members.index(member)} could not start on node {member.node_id[:12]}: {error}"
            )
            self.members.remove(member)
            return False
        member.run = member.actor.run.remote()
        member.writer_id, member.lease_id = identity["writer_id"], identity["lease_id"]
        member.state = WorkerState.GENERATING
        return True

    # ------------------------------------------------------------------ poll
    def poll(self) -> None:
        """Replace dead workers, drop those whose node left; raises RolloutWorkersLost past the budget or
        when a worker's loop ended by itself."""
        import ray

        running = {m.run: m for m in self.members if m.state is WorkerState.GENERATING}
        done, _ = ray.wait(list(running), timeout=0)
        for ref in done:
            member = running[ref]
            index = self.members.index(member)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._handle_death(member, index, error)
                continue
            raise RolloutWorkersLost(f"rollout worker {index} stopped unexpectedly")

    def _handle_death(self, member: RolloutMember, index: int, error: BaseException) -> None:
        import ray

        ray.get(self.controller.retire_worker.remote(member.lease_id), timeout=60)
        node = member.node_id
        if node is not None and not any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes()):
            self.members.remove(member)
            self.say(
                f"rollout worker {index} left with its node {node[:12]}; its leases were fenced "
                "and its tasks returned to the queue"
            )
        else:
            self.restart(member, error)
        writers = [m.writer_id for m in self.members if m.writer_id]
        report = ray.get(self.controller.reap_writers.remote(writers), timeout=120)
        self.say(f"released {report.get('publications_released', 0)} unaccepted publication(s) of the dead worker")

    def restart(self, member: RolloutMember, cause: BaseException) -> None:
        """A new worker in ``member``'s place (on its node, if it had one)."""
        self.restarts += 1
        index = self.members.index(member)
        if self.restarts > self.max_restarts:
            raise RolloutWorkersLost(f"rollout workers died {self.restarts} times; last: {cause}")
        self.say(f"rollout worker {index} died; starting a new one ({self.restarts}/{self.max_restarts})")
        replacement = RolloutMember(self.make_actor(index, member.node_id), node_id=member.node_id)
        self.members[index] = replacement
        self._launch(replacement)

    def stats(self, timeout: float = 10.0) -> list:
        """Every generating worker's counters (vime.workers.rollout_worker.WorkerStats)."""
        import ray

        return ray.get([actor.get_stats.remote() for actor in self.actors], timeout=timeout)

    # ------------------------------------------------------------------ stop
    def stop(self, abort_requests: Callable[[], None], wait_seconds: float) -> None:
        """Stop generating: each worker is told to stop, ``abort_requests`` ends the engines' requests in
        flight (their groups go back to the queue as continuations instead of being waited for), and each
        worker's run loop is waited for up to ``wait_seconds`` in all; what each contributed is recorded."""
        import ray

        generating = [m for m in self.members if m.state is WorkerState.GENERATING]
        if not generating:
            return
        for member in generating:
            try:
                ray.get(member.actor.stop.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # already dead: its leases expire or are fenced
        abort_requests()
        runs = [m.run for m in generating]
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=wait_seconds)
        for index, member in enumerate(generating):  # what each worker contributed (docs/elastic.md)
            if member.run not in done:
                continue
            try:
                stats = ray.get(member.run)
            except ray.exceptions.RayError:
                continue
            self.record(
                {
                    "kind": "rollout_worker",
                    "worker": index,
                    "node_id": member.node_id,
                    "groups_accepted": stats.groups_accepted,
                    "groups_yielded": stats.groups_yielded,
                    "response_tokens": stats.response_tokens,
                    "errors": stats.errors,
                }
            )
        self.members = []

    def kill_unlaunched(self) -> None:
        """A run that fails between creating worker 0 and launching it stops that actor too."""
        import ray

        for member in self.members:
            if member.state is WorkerState.CREATED:
                ray.kill(member.actor)
        self.members = [m for m in self.members if m.state is not WorkerState.CREATED]
