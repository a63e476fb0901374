"""The run's controller: the one owner of the task queue (a Ray actor, restartable).

It refills prompts from the dataset (the dataset cursor moves in the same journal transaction as
the submission), hands leases to rollout workers under the staleness admission bound, accepts
their groups exactly once, and feeds accepted groups to the trainer in order. Calls are served
one at a time, which is what straw's single-writer Coordinator needs: every method but
:meth:`Controller.lease_or_wait` is a plain one, and Ray runs an asynchronous actor's plain methods on its
event loop, each to its end; ``lease_or_wait`` gives way only while it waits, never inside a queue call.

On crash: the fence is released with the process; a new controller recovers the queue from its
journal, every lease of the dead incarnation is fenced and its task returns to the queue.

The driver names the actor :attr:`Controller.ACTOR_NAME` in the run's Ray namespace, so that
``vime queue retry-failed --run RUN_DIR`` reaches a live run (as ``vime engines`` reaches the
engine registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from straw import Record
from straw.errors import CorruptData, IndeterminateCommit, StorageUnavailable, UnsafeRecovery

from vime.data.source import DataKeys, DatasetCursor, PromptRecord, PromptSubset, open_prompt_source
from vime.errors import UserError
from vime.queue.fence import QueueFence
from vime.queue.gc import reap_writers, writer_ids
from vime.queue.memory_queue import MemoryRolloutQueue
from vime.queue.records import decode_group
from vime.queue.rollout_queue import IdempotencyConflict, StaleLease, StoreOptions, StrawRolloutQueue
from vime.queue.tasks import REJECTED_PREFIX, AcceptedGroup, Assignment, PromptTask, RetryReport, regenerated_id
from vime.queue.transport import ObjectStoreTransport
from vime.recovery.disk_full import WrittenVolume
from vime.recovery.faults import CONTROLLER_STRAW, StrawWriteFaults, fault_point
from vime.recovery.lineage import Lineage
from vime.recovery.volume_failure import (
    VOLUME_WAIT_SECONDS,
    count_volume_restart,
    end_this_process,
    forget_volume_restarts,
    ridden_out_cause,
    volume_restarts_refusal,
    wait_until_writable,
)

logger = logging.getLogger(__name__)

# A waiting lease_or_wait also looks again this often by itself, for what no call announces (a lease that expired
# returns its prompt to the queue).
LEASE_RECHECK_SECONDS = 0.25


# straw's errors for a write of the queue that failed (a file system call, or a journal append whose outcome is
# unknown), and what its coordinator and store answer after one: every call refused until a new owner recovers.
FAILED_WRITE = (StorageUnavailable, IndeterminateCommit)
AFTER_A_FAILED_WRITE = (UnsafeRecovery, IndeterminateCommit, CorruptData)


class QueueBroken(UserError, RuntimeError):
    """A queue call refused because an earlier write of the queue failed: says both, so that the driver names the
    volume's own error (recovery/disk_full.py) instead of the refusal's; the user resumes once the volume answers.
    One argument, as Ray rebuilds it."""


def refuse_if_refused(refusal: OSError | None) -> None:
    """Raise the volume's error of an incarnation that refused the queue (None: it took it). Each time without the
    traceback of the times before: one exception object answers every call, and each raise would add its frames."""
    if refusal is not None:
        raise refusal.with_traceback(None)


def on_the_queue(method: Callable) -> Callable:
    """A controller call on the queue. It runs only while this controller still holds the queue's fence (else
    :class:`QueueTaken`: another controller took the queue while this one was taken for gone; queue/fence.py). The
    first write of the queue that fails is remembered; a later call that straw refuses because of it raises
    :class:`QueueBroken` with that failure's own error (straw's refusal names none: "Coordinator unavailable; stop
    owner and recover")."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        refuse_if_refused(self.refusal)
        if self.fence is not None:
            self.fence.ensure_held()
        try:
            return method(self, *args, **kwargs)
        except AFTER_A_FAILED_WRITE + FAILED_WRITE as error:
            failed = self.queue_failure
            if failed is None and isinstance(error, FAILED_WRITE):
                self.queue_failure = error
                self.first_failed_write(error)  # may end the process: a new owner recovers the queue
            elif failed is not None and failed is not error and isinstance(error, AFTER_A_FAILED_WRITE):
                raise QueueBroken(
                    f"{type(error).__name__}: {error}, after an earlier write of the queue failed: "
                    f"{type(failed).__name__}: {failed}"
                ) from error
            raise  # the failed write itself (also through an outer call that made this one) reaches the caller as is

    return call


def announces_admission(method: Callable) -> Callable:
    """A controller call after which more groups may be leasable (a trained step, a group accepted, returned or
    failed, ...): the leases waiting in :meth:`Controller.lease_or_wait` look again."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self.admission_changed.set()

    return call


@dataclasses.dataclass(kw_only=True)
class ControllerSpec:
    transport: str  # straw | object-store
    store: StoreOptions
    lease_seconds: float
    prompt_data: str
    keys: DataKeys
    seed: int
    shuffle: bool
    num_epoch: int | None
    groups_per_rollout: int  # --rollout-batch-size
    max_staleness: int
    data_source_path: str | None = None  # --data-source-path: a custom source instead of prompt_data
    args: Any = None  # handed to the custom source's constructor
    # --rollout-max-prompt-len: the source's rows within the limit (computed once at start-up, so that every
    # incarnation numbers the prompts alike); None: every row.
    prompt_rows: list[int] | None = None
    # --over-sampling-batch-size: fresh prompts enter the queue in multiples of it; None: a plain top-up.
    refill_multiple: int | None = None
    # The controller runs as a Ray actor that Ray restarts (the driver's): a write of the queue that its volume
    # failed ends the process, and the next incarnation recovers the queue (recovery/volume_failure.py). False
    # (a controller made in-process): the error goes on to the caller.
    restart_on_volume_failure: bool = False
    volume_wait_seconds: float = VOLUME_WAIT_SECONDS  # how long a new incarnation waits for the volume to take a write


@dataclasses.dataclass(frozen=True)
class LeasedPrompt:
    """What a rollout worker receives: the task, its lease, the prompt and a durable prefix if any."""

    assignment: Assignment
    prompt: PromptRecord
    version: int  # weights the engines serve at lease time


@dataclasses.dataclass(frozen=True)
class TakenGroups:
    groups: list[AcceptedGroup]  # to train, in acceptance order
    skipped: list[int]  # positions too stale to train (their prompts were submitted again)
    next_cursor: int  # the cursor after this batch


@dataclasses.dataclass
class ControllerStats:
    weight_version: int
    pending: int
    leased: int
    accepted: int
    consumed: int
    failed: int
    accepted_response_tokens: int
    accepted_samples: int
    end_of_data: bool
    reclaimed_bytes: int
    regenerated: int
    rejected: int = 0  # groups the dynamic filter dropped (this controller incarnation; also in failed)
    incarnation: str = ""  # the controller's: a new one after each restart (StepRecords counts them)

    @property
    def queue_depth(self) -> int:
        """Accepted groups waiting for the trainer."""
        return self.accepted - self.consumed


class Controller:
    ACTOR_NAME = "vime-controller"  # the Ray actor's name in the run's namespace

    def __init__(self, spec: ControllerSpec):
        self.spec = spec
        self.incarnation = f"controller-{uuid.uuid4().hex[:12]}"
        self.dataset = open_prompt_source(
            spec.prompt_data, spec.keys, data_source_path=spec.data_source_path, args=spec.args
        )
        if spec.prompt_rows is not None:
            self.dataset = PromptSubset(self.dataset, spec.prompt_rows)
        self.weight_version = 0
        self.accepted_response_tokens = 0
        self.accepted_samples = 0
        self.reclaimed_bytes = 0
        self.rejected: set[str] = set()  # task ids the dynamic filter dropped (this incarnation)
        self.min_versions: dict[int, int] = {}  # oldest token version of each accepted group
        self.token_versions: dict[int, frozenset[int]] = {}  # every version of a group that may carry lost ones
        self.lineage = Lineage()  # the driver's, restated by sync()/take_groups()
        self.regenerated: set[int] = set()  # positions whose prompt was submitted again
        # At most the fresh prompts pending: counted by _refill, lowered by every fresh task lease() hands out
        # (the only way one leaves the pending set; expiries and returns only add). While it says enough are
        # pending, _refill skips its scan of the whole pending set (bench/scale: O(2 batches) per lease).
        self.fresh_pending_floor = 0
        self.admission_changed = asyncio.Event()  # set by every @announces_admission call
        self.group_accepted = asyncio.Event()  # set by every complete() that accepts a group: take_groups_or_wait
        self.queue_failure: Exception | None = None  # the first failed write of the queue (@on_the_queue)
        self.queue_volume = WrittenVolume.queue(spec.store.data_dir, spec.store.segment_mib, save=None)
        self.fence = None
        # The volume's error, where this incarnation refuses to take the queue: every call answers it.
        self.refusal: OSError | None = None
        if spec.transport == "straw" and spec.restart_on_volume_failure:
            # Maybe the incarnation after a failed write: the volume takes a write first. A volume still failing
            # after the wait, or whose last few incarnations met the same failure, ends the run: not by raising
            # here (Ray would print that error, traceback and all, for each call in flight, before the driver's
            # one line), but by coming up without the queue and answering every call with the volume's error,
            # which the driver reports naming --rollout-data-dir.
            try:
                wait_until_writable(spec.store.data_dir, wait_seconds=spec.volume_wait_seconds, say=logger.warning)
                self.refusal = volume_restarts_refusal(spec.store.data_dir)
            except OSError as error:
                self.refusal = error
            if self.refusal is not None:
                logger.error(f"{self.incarnation}: not taking the queue: {self.refusal}")
                return
        try:
            self._open_queue()
        except (*FAILED_WRITE, OSError) as error:
            # No decorated call runs inside, and a failed start leaves no controller to remember it: only told.
            self.first_failed_write(error)  # may end the process; otherwise this incarnation's start fails
            raise

    def _open_queue(self) -> None:
        """Take the queue (recovering it from its journal, when it has one) and what this incarnation reads of it."""
        spec = self.spec
        if spec.transport == "straw":
            self.fence = QueueFence.acquire(spec.store.data_dir)
            self.queue = StrawRolloutQueue.open(
                spec.store,
                owner=self.incarnation,
                lease_seconds=spec.lease_seconds,
                fault=StrawWriteFaults.if_enabled(CONTROLLER_STRAW),
            )
        else:
            self.queue = MemoryRolloutQueue(lease_seconds=spec.lease_seconds)
        state = self.queue.dataset_cursor() or {}
        self.cursor = DatasetCursor(state.get("epoch", 0), state.get("offset", 0))
        self.next_group_index = state.get("next_group_index", 0)
        self.consumer_token = self.queue.open_consumer(self.incarnation)
        # Groups handed to the trainer. The driver owns the real cursor and states it with every
        # take_groups()/sync() call (a restarted controller learns it from the next call); until then
        # the queue's committed cursor is the best lower bound.
        self.consumed = self.queue.consumer_cursor()
        self.trained = self.consumed  # groups trained: consumed minus those skipped as stale
        self.accepted = self._count_accepted()
        self._refill()

    def first_failed_write(self, error: BaseException) -> None:
        """The first write of the queue that failed (@on_the_queue, or opening it). Where the volume failed the call
        (not full, not gone) and Ray restarts this actor (``restart_on_volume_failure``), the process ends here so
        that a new owner recovers the queue, as straw asks ("stop owner and recover"; recovery/volume_failure.py).
        Otherwise the error goes on to the caller: the driver stops, naming the volume (recovery/disk_full.py)."""
        if not self.spec.restart_on_volume_failure:
            return
        cause = ridden_out_cause(self.queue_volume, error)
        if cause is None:
            return
        message = (
            f"{self.incarnation}: a write of the queue in {self.spec.store.data_dir} failed ({cause}): ending this "
            "process so that a new controller recovers the queue from its journal (Ray restarts it)"
        )
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        count_volume_restart(self.spec.store.data_dir)
        end_this_process()

    # ------------------------------------------------------------------ lifecycle
    def ready(self) -> dict[str, Any]:
        refuse_if_refused(self.refusal)
        return {
            "incarnation": self.incarnation,
            "consumed": self.consumed,
            "accepted": self.accepted,
            "dataset_size": len(self.dataset),
        }

    def shutdown(self) -> None:
        if self.refusal is not None:
            return  # it never took the queue
        if self.fence is None or self.fence.taken_by is None:  # a queue another controller took is left to it
            self.queue.close()
        if self.fence is not None:
            self.fence.release()

    def _count_accepted(self) -> int:
        # History before the committed cursor may already be reclaimed; count from there.
        cursor = total = self.queue.consumer_cursor()
        while True:
            groups, cursor = self.queue.accepted(cursor, 1000)
            if not groups:
                return total
            total = groups[-1].position + 1

    # ------------------------------------------------------------------ prompts
    def _refill(self) -> None:
        """Keep about two rollouts' worth of fresh prompts pending (and never run dry); with
        --over-sampling-batch-size they are added in multiples of it.

        A top-up adds at least half a rollout's worth: counting the pending prompts reads every pending
        task from the journal, and adding them is a journal transaction, both too slow to repeat at every
        lease of a large batch (bench/scale: 7 ms a lease at --rollout-batch-size 256)."""
        target = 2 * self.spec.groups_per_rollout
        if self.fresh_pending_floor >= target:
            return
        pending = sum(1 for t in self.queue.pending() if t.stage == "fresh")
        self.fresh_pending_floor = pending
        want = target - pending
        if want <= 0:
            return
        want = max(want, self.spec.groups_per_rollout // 2)
        if self.spec.refill_multiple:
            want = -(-want // self.spec.refill_multiple) * self.spec.refill_multiple
        taken = self.cursor.take(
            self.dataset, want, seed=self.spec.seed, shuffle=self.spec.shuffle, num_epoch=self.spec.num_epoch
        )
        if not taken:
            return
        tasks = [PromptTask.make(self.next_group_index + i, epoch, row) for i, (epoch, row) in enumerate(taken)]
        self.next_group_index += len(tasks)
        self.queue.submit(
            tasks, {"epoch": self.cursor.epoch, "offset": self.cursor.offset, "next_group_index": self.next_group_index}
        )
        self.fresh_pending_floor += len(tasks)

    # ------------------------------------------------------------------ rollout workers
    def _admissible(self) -> int:
        """Groups that may still start without exceeding --max-staleness.

        A group leased now is trained at about step (trained + outstanding) / B, while the policy
        is at version ``weight_version``; the bound keeps that at most max_staleness steps ahead.
        Groups found too stale count for nothing: they will never be trained (their prompts run again).
        With --update-weights-interval a version spans several steps: the steps trained count then (a version
        moves at most once a step, so a group trained within max_staleness + 1 steps of its lease is at most
        max_staleness versions old); with a version each step the two counts are the same.
        """
        counts = self.queue.counts()
        stale_ahead = sum(1 for position in self.regenerated if position >= self.consumed)
        outstanding = counts.get("leased", 0) + (self.accepted - self.consumed - stale_ahead)
        # A restore's jump in version numbering is no step.
        step = max(self.lineage.step_of(self.weight_version), self.trained // self.spec.groups_per_rollout)
        limit = (step + self.spec.max_staleness + 1) * self.spec.groups_per_rollout
        return max(0, limit - self.trained - outstanding)

    @on_the_queue
    def lease(self, worker_id: str, max_tasks: int) -> list[LeasedPrompt]:
        self._refill()
        count = min(max_tasks, self._admissible())
        if count <= 0:
            return []
        assignments = self.queue.acquire(worker_id, count)
        self.fresh_pending_floor -= sum(1 for a in assignments if a.task.stage == "fresh")
        return [LeasedPrompt(a, self.dataset[a.task.prompt_index], self.weight_version) for a in assignments]

    async def lease_or_wait(self, worker_id: str, max_tasks: int, wait_seconds: float) -> list[LeasedPrompt]:
        """:meth:`lease`; while that hands out nothing, up to ``wait_seconds`` waiting for a call that may change
        it (``announces_admission``), looking again every LEASE_RECHECK_SECONDS for what no call announces.
        Returns [] if nothing could be leased by then.

        Why: a rollout worker with free slots asked :meth:`lease` every 20 ms while the staleness bound admitted
        nothing (the trainer training), and the two sides of each Ray call cost ~1 ms of CPU each: ~0.15 of a
        core taken from the engine and the trainer on a 2-core machine (bench/rollout/idle_lease.py: 0.02 now).
        Waiting here, the worker makes one call per ``wait_seconds`` then, and leases as soon as the driver's
        sync() or take_groups() admits it."""
        deadline = time.monotonic() + wait_seconds
        while True:
            leased = self.lease(worker_id, max_tasks)
            remaining = deadline - time.monotonic()
            if leased or remaining <= 0:
                return leased
            self.admission_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.admission_changed.wait(), min(remaining, LEASE_RECHECK_SECONDS))

    @on_the_queue
    def heartbeat(self, leases: list) -> list[bool]:
        return self.queue.heartbeat(leases)

    @announces_admission
    @on_the_queue
    def complete(
        self, lease, submission_id: str, ref, num_samples: int, response_tokens: int, min_version: int
    ) -> int | None:
        """Accept a group. Returns its position, or None if the lease is stale (work discarded)."""
        try:
            position = self.queue.complete(lease, submission_id, ref)
        except StaleLease:
            return None
        self.min_versions[position] = min_version
        if position >= self.accepted:
            self.accepted = position + 1
            self.accepted_samples += num_samples
            self.accepted_response_tokens += response_tokens
            self.group_accepted.set()
        return position

    @announces_admission
    @on_the_queue
    def return_partial(self, lease, task: PromptTask, partial_ref) -> bool:
        try:
            self.queue.return_partial(lease, task, partial_ref, request_id=f"return-{uuid.uuid4().hex}")
            return True
        except StaleLease:
            return False

    @announces_admission
    @on_the_queue
    def fail(self, lease, reason: str) -> bool:
        try:
            self.queue.fail(lease, reason, request_id=f"fail-{uuid.uuid4().hex}")
            return True
        except StaleLease:
            return False

    @announces_admission
    @on_the_queue
    def reject(self, lease, reason: str) -> bool:
        """End a task whose group --dynamic-sampling-filter-path dropped: terminal stage *rejected*
        (a non-retryable failure whose reason starts with 'rejected:'), never trained, prompt not
        regenerated. False if the lease is no longer current."""
        try:
            self.queue.fail(
                lease,
                f"{REJECTED_PREFIX} {reason}",
                request_id=f"reject-{lease.task_id}-{lease.attempt_id}",
                retryable=False,
            )
        except (StaleLease, IdempotencyConflict):  # IdempotencyConflict: rejected before, for another reason
            return False
        self.rejected.add(lease.task_id)  # a replayed call (same request id) counts once
        return True

    @announces_admission
    @on_the_queue
    def retry_failed(self) -> RetryReport:
        """Return every failed task, except the rejected ones, to the queue as a fresh prompt with
        a new attempt budget (``vime queue retry-failed --run``). Idempotent: a second call retries
        nothing; a call Ray replays after a controller restart finds the retries already submitted."""
        report = self.queue.retry_failed()
        if report.retried:
            logger.warning(
                "retried %d failed task(s) as fresh prompts (first: %s)", len(report.retried), report.retried[0][0]
            )
        return report

    # ------------------------------------------------------------------ trainer
    @announces_admission
    @on_the_queue
    def sync(self, weight_version: int, cursor: int, trained: int, lineage: Lineage | None = None) -> None:
        """The driver's view: every engine serves ``weight_version``, the groups before ``cursor``
        are done with, ``trained`` of them were trained, ``lineage`` says which versions were lost to
        a trainer restored in place (recovery/lineage.py). Admission moves on with them. Idempotent;
        the cursor may move back (a restored trainer retrains the groups after its checkpoint)."""
        self.weight_version = weight_version
        self.consumed, self.trained = cursor, trained
        if lineage is not None:
            self.lineage = lineage

    @announces_admission
    @on_the_queue
    def take_groups(
        self,
        cursor: int,
        count: int,
        weight_version: int,
        trained: int,
        *,
        allow_partial: bool = False,
        lineage: Lineage | None = None,
    ) -> TakenGroups:
        """The next ``count`` trainable accepted groups from ``cursor`` on, in acceptance order, or
        none until that many exist (``allow_partial``: whatever exists, for the last step).

        A group whose oldest token is more than --max-staleness steps (of the surviving lineage:
        ``lineage``) older than ``weight_version`` (the policy that would train it) is skipped and its prompt submitted
        again: it is never trained, and never lost. So is a group carrying a token of a lost version
        (weights of steps a restored trainer threw away), and a group whose prompt was already submitted
        again (in a lineage that was lost since): its prompt is trained through the resubmission only.
        Every call restates the driver's view (as sync() does), so a restarted controller admits work
        again as soon as the trainer asks.
        """
        self.sync(weight_version, cursor, trained, lineage)
        groups, skipped, position = [], [], cursor
        while len(groups) < count and position < self.accepted:
            page, _ = self.queue.accepted(position, min(count - len(groups), self.accepted - position))
            if not page:
                break
            for group in page:
                if not self._trainable(group, weight_version):
                    skipped.append(group.position)
                    self._regenerate(group)
                else:
                    groups.append(group)
            position = page[-1].position + 1
        if len(groups) < count and not (allow_partial and position >= self.accepted):
            return TakenGroups([], [], cursor)
        return TakenGroups(groups, skipped, position)

    async def take_groups_or_wait(
        self,
        cursor: int,
        count: int,
        weight_version: int,
        trained: int,
        *,
        lineage: Lineage | None = None,
        wait_seconds: float,
    ) -> TakenGroups:
        """:meth:`take_groups`; while that takes nothing, up to ``wait_seconds`` waiting for a group to be accepted
        (nothing else adds a group to take). Returns no groups if there were not ``count`` by then.

        Why: the driver asked take_groups (and stats) every 50 ms while it waited for a step's groups: ~40 Ray calls a
        second, each ~0.6 CPU-ms on each side, taken from the engines and the trainer on a small machine
        (bench/rollout's long shape: 0.04 of a core in the driver and about as much here, a tenth of what vime's
        own processes took there). Waiting here, it calls once per ``wait_seconds`` and takes a step's groups as
        soon as the last one is accepted."""
        deadline = time.monotonic() + wait_seconds
        taken = self.take_groups(cursor, count, weight_version, trained, lineage=lineage)
        while not taken.groups:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return taken
            self.group_accepted.clear()  # no await since take_groups looked: an acceptance now wakes the wait
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.group_accepted.wait(), remaining)
            # Each look reads the accepted groups from the cursor on: only once there are enough of them for a step
            # (at a large --rollout-batch-size a look per acceptance would read the batch once per group).
            if self.accepted - cursor >= count:
                taken = self.take_groups(cursor, count, weight_version, trained, lineage=lineage)
        return taken

    def _trainable(self, group: AcceptedGroup, weight_version: int) -> bool:
        """Whether the policy at ``weight_version`` may train ``group`` (see take_groups)."""
        if group.position in self.regenerated or self.queue.has_task(regenerated_id(group.position)):
            return False
        oldest = self._min_version(group)
        if oldest is None:
            return True  # unreadable here: the trainer reads it and stops the run naming the group
        if oldest <= self.lineage.newest_lost:  # it may carry tokens of lost versions: look at every one
            versions = self._token_versions(group)
            if versions is not None and any(self.lineage.lost(v) for v in versions):
                return False
        return self.lineage.staleness(weight_version, oldest) <= self.spec.max_staleness

    def _read_samples(self, group: AcceptedGroup) -> list | None:
        try:
            if isinstance(self.queue, StrawRolloutQueue):
                return decode_group(list(self.queue.store.read(group.ref)))
            return ObjectStoreTransport().read(group.ref)
        except Exception as error:  # noqa: BLE001 - corrupt or reclaimed: not the controller's call to make
            logger.warning(
                "accepted group %s: payload unreadable (%s); leaving it to the trainer", group.task_id, error
            )
            return None

    def _token_versions(self, group: AcceptedGroup) -> frozenset[int] | None:
        if group.position not in self.token_versions:
            samples = self._read_samples(group)
            if samples is None:
                return None
            self.token_versions[group.position] = frozenset(v for s in samples for v in s.weight_versions)
        return self.token_versions[group.position]

    def _min_version(self, group: AcceptedGroup) -> int | None:
        """The oldest token version of an accepted group; None when its payload cannot be read
        here (the trainer then reads it and stops the run naming the group)."""
        if group.position not in self.min_versions:  # accepted before a controller restart
            versions = self._token_versions(group)
            if versions is None:
                return None
            self.min_versions[group.position] = min(versions, default=0)
        return self.min_versions[group.position]

    def _regenerate(self, group: AcceptedGroup) -> None:
        if group.position in self.regenerated:
            return
        task = self.queue.task(group.task_id).regenerated(group.position)
        self.queue.regenerate(task, request_id=f"regenerate-{group.position}")  # idempotent across restarts
        self.regenerated.add(group.position)

    @announces_admission
    @on_the_queue
    def commit(self, step: int, cursor: int, step_cursors: list[int], skipped: list[int]) -> None:
        """Durably mark the accepted groups before ``cursor`` as trained by step ``step``.

        ``step_cursors[i]`` is the cursor after step i + 1 of the surviving lineage: which step
        trained which group, for inspection.
        """
        state_ref = None
        if isinstance(self.queue, StrawRolloutQueue):
            # the lineage too: `vime queue inspect` tells the lost versions from it without a checkpoint
            payload = json.dumps(
                {
                    "step": step,
                    "cursor": cursor,
                    "weight_version": self.weight_version,
                    "step_cursors": step_cursors,
                    "skipped": skipped,
                    "lineage": msgspec.to_builtins(self.lineage),
                }
            ).encode()
            state_ref = self.queue.store.publish(
                [Record("consumer-state", payload, "json.v1")],
                submission_id=f"consumer-state-{self.incarnation}-{step}",
            )
        fault_point("controller.mid_commit")
        # Request ids are unique per incarnation: a resumed (older) lineage re-commits steps an
        # earlier one committed with other content, and a commit retried after a controller restart
        # comes from a new incarnation. The cursor may move backward (resuming an older checkpoint).
        self.queue.commit_consumer(
            self.consumer_token, cursor, state_ref, request_id=f"commit-{self.incarnation}-{step}-{cursor}"
        )
        if self.spec.restart_on_volume_failure:
            forget_volume_restarts(self.spec.store.data_dir)  # the queue's writes go through again
        if self.spec.store.collect_online:
            report = self.queue.collect_garbage()
            self.reclaimed_bytes += report.get("reclaimed_bytes", 0)

    @on_the_queue
    def newest_token_version(self, cursor: int) -> int:
        """The newest weight version a token of any accepted group from ``cursor`` on came from (-1: none,
        or none readable). On --load: the versions the run before published after its checkpoint, which
        the resumed run must not give out again (recovery/lineage.py)."""
        newest, position = -1, cursor
        while position < self.accepted:
            page, _ = self.queue.accepted(position, min(256, self.accepted - position))
            if not page:
                break
            for group in page:
                versions = self._token_versions(group)  # None, unreadable: the trainer stops the run naming it
                newest = max([newest, *(versions or ())])
            position = page[-1].position + 1
        return newest

    @on_the_queue
    def history_available(self, cursor: int) -> bool:
        return self.queue.history_available(cursor)

    @announces_admission
    @on_the_queue
    def retire_worker(self, lease_id: str) -> None:
        """Fence every lease of a rollout worker known to be dead (its process, or its node, is
        gone): its tasks return to the queue now instead of when their leases expire, and the id
        can never lease again. The in-memory queue lets the leases expire."""
        if isinstance(self.queue, StrawRolloutQueue):
            self.queue.coordinator.retire_worker(lease_id)

    @announces_admission
    @on_the_queue
    def reap_writers(self, alive: list[str]) -> dict[str, int]:
        """Release what dead producers published but never got accepted (every straw writer of
        this queue except ours and those in ``alive``): what their last calls may have left, since this holds up the
        queue (``thorough=False``, queue/gc.py; `vime queue gc` after the run looks at everything)."""
        if not isinstance(self.queue, StrawRolloutQueue):
            return {}
        keep = set(alive) | {self.queue.store.writer_id}
        dead = [w for w in writer_ids(self.spec.store.data_dir) if w not in keep]
        return reap_writers(self.queue.store, self.spec.store.data_dir, dead, thorough=False)

    @on_the_queue
    def stats(self) -> ControllerStats:
        counts = self.queue.counts()
        return ControllerStats(
            weight_version=self.weight_version,
            pending=counts.get("pending", 0),
            leased=counts.get("leased", 0),
            accepted=self.accepted,
            consumed=self.consumed,
            failed=counts.get("failed", 0),
            accepted_response_tokens=self.accepted_response_tokens,
            accepted_samples=self.accepted_samples,
            end_of_data=self._end_of_data(counts),
            reclaimed_bytes=self.reclaimed_bytes,
            regenerated=len(self.regenerated),
            rejected=len(self.rejected),
            incarnation=self.incarnation,
        )

    def _end_of_data(self, counts: dict[str, int]) -> bool:
        exhausted = self.spec.num_epoch is not None and self.cursor.epoch >= self.spec.num_epoch
        return exhausted and counts.get("pending", 0) == 0 and counts.get("leased", 0) == 0
