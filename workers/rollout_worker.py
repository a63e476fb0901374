"""Rollout worker (one Ray actor per rollout node): lease prompts, generate, score, publish.

It never waits for the trainer: while groups are admitted it keeps up to
``max_concurrent_groups`` groups in flight, each sample a request through the router. A finished
group is written to the transport (payload) and accepted by the controller (reference only).
A sample aborted by a weight update is continued from its prefix (``--partial-rollout``) or
regenerated. Leases are renewed by heartbeat; a lease the controller no longer honours cancels its
group while it is still generating (another worker owns that prompt now); a group already generated is
left to end, and the controller's answer to its outcome (accepted or not) is what counts it.
With ``--use-opd`` a scored group's samples also get the teacher's log-probs
(vime.rollout.teacher) before it is published.

On crash: nothing of the worker's is lost — its leases expire (or are fenced) and the prompts go
back to the queue; a group it had already accepted stays accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp

from vime.data.prompt import render_prompt
from vime.data.tokenizer import load_tokenizer
from vime.errors import MemberDied
from vime.queue.gc import group_submission_id, partial_submission_id
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import GroupToPublish, make_transport
from vime.recovery import faults
from vime.recovery.disk_full import DiskFull, RunVolumes, WrittenVolume
from vime.recovery.faults import StrawWriteFaults, fault_point
from vime.rollout.filters import FLAG as FILTER_FLAG, interpret as interpret_filter
from vime.rollout.generate import (
    GenerateError,
    SamplingParams,
    generate,
    generate_group,
    refused_for_n,
    sampling_params_from_rollout,
    sends_request,
)
from vime.rollout.rewards import RewardOptions, resolve_reward
from vime.rollout.teacher import attach_teacher_log_probs
from vime.rollout.types import RolloutFnTrainOutput
from vime.runtime.plugins import call_maybe_async, load_hook
from vime.sample import Sample, Status
from vime.workers.group_publisher import GroupPublisher

logger = logging.getLogger("vime.rollout")

ALL_SAMPLES_FLAG = "--rollout-all-samples-process-path"
GET_SAMPLES_GRACE_SECONDS = 0.5
ENGINE_RETRY_SECONDS = 1.0
# A lease call that finds nothing admissible (the staleness bound, an empty queue) waits this long in the controller
# for that to change (Controller.lease_or_wait); stop() is noticed when it returns.
LEASE_WAIT_SECONDS = 0.5


class GroupPhase(enum.Enum):
    GENERATING = "generating"  # the heartbeat cancels it once its lease is lost: the engines' work is saved
    ENDING = "ending"  # generated: scored, published and handed to the controller, whose answer counts it


@dataclasses.dataclass
class InFlight:
    """A leased group this worker is working on (``RolloutWorker.active``)."""

    task: asyncio.Task
    lease: object
    phase: GroupPhase = GroupPhase.GENERATING


class InfrastructureFault(MemberDied, RuntimeError):
    """A group could not be finished for a reason that is not the sample's (its payload could not be
    written, say): the task goes back to the queue untouched, no attempt spent."""


@dataclasses.dataclass(kw_only=True)
class RolloutWorkerSpec:
    worker_id: str
    router_url: str
    hf_checkpoint: str
    transport: str
    store: StoreOptions
    n_samples_per_prompt: int
    sampling: SamplingParams
    max_concurrent_groups: int
    partial_rollout: bool
    apply_chat_template: bool
    reward: RewardOptions
    custom_generate_function_path: str | None
    rollout_function_path: str | None
    request_timeout: float
    lease_seconds: float
    group_requests: bool  # --rollout-group-requests: a group's fresh samples in one request (vLLM's n)
    args: argparse.Namespace  # handed to user hooks, as the reference framework does
    dynamic_sampling_filter_path: str | None = None
    apply_chat_template_kwargs: dict | None = None  # --apply-chat-template-kwargs
    rollout_all_samples_process_path: str | None = None  # called on every scored group, kept or filtered
    # The queue's directory, said by its flag when it fills (recovery/disk_full.py); None: not checked.
    queue_volume: WrittenVolume | None = None

    @classmethod
    def from_settings(cls, s, *, index: int, router_url: str, store: StoreOptions) -> RolloutWorkerSpec:
        """Rollout worker ``index`` of a ``vime train`` run (its id is new at every start: a replacement never
        takes over a dead worker's leases or writer)."""
        r, a = s.rollout, s.algorithm
        sampling = sampling_params_from_rollout(
            r,
            # Score centering: the rollout records the sampler's heads or top-p supports (never at evaluation).
            score_centering_top_k=a.score_centering_top_k if a.use_score_centering else 0,
            routing_replay=s.megatron.use_rollout_routing_replay,
        )
        return cls(
            worker_id=f"rollout-{index}-{uuid.uuid4().hex[:6]}",
            router_url=router_url,
            hf_checkpoint=s.train.hf_checkpoint,
            transport=s.queue.rollout_data_transport,
            store=store,
            n_samples_per_prompt=r.n_samples_per_prompt,
            sampling=sampling,
            max_concurrent_groups=r.max_concurrent_groups,
            partial_rollout=r.partial_rollout,
            apply_chat_template=s.data.apply_chat_template,
            apply_chat_template_kwargs=s.data.apply_chat_template_kwargs,
            rollout_all_samples_process_path=s.hooks.rollout_all_samples_process_path,
            reward=RewardOptions.from_config(r),
            custom_generate_function_path=r.custom_generate_function_path,
            rollout_function_path=r.rollout_function_path,
            dynamic_sampling_filter_path=r.dynamic_sampling_filter_path,
            request_timeout=r.rollout_request_timeout,
            lease_seconds=s.queue.rollout_queue_lease_seconds,
            group_requests=r.rollout_group_requests,
            args=s.args,
            queue_volume=RunVolumes.from_settings(s).queue,
        )


def create_rollout_actor(spec: RolloutWorkerSpec, controller, node_id: str | None = None):
    """The worker's Ray actor (anywhere, or pinned to ``node_id``), its queue not opened yet."""
    import ray

    options = {}
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(num_cpus=0)(RolloutWorker).options(**options).remote(spec, controller)


@dataclasses.dataclass
class RolloutWorkerStats:
    groups_accepted: int = 0
    groups_discarded: int = 0
    groups_yielded: int = 0
    groups_rejected: int = 0  # dropped by --dynamic-sampling-filter-path (never trained)
    rejected_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    samples_aborted: int = 0
    response_tokens: int = 0
    errors: int = 0  # groups that failed (spent an attempt of their task)
    last_error: str = ""
    engine_errors: int = 0  # requests an engine failed (no attempt spent: the group went back)
    generate_requests: int = 0  # generate requests sent (custom generate functions' own not counted)
    queue_publications: int = 0  # straw publications of finished groups (one for each set that finished together)
    last_engine_error: str = ""


def fresh_samples_of_one_prompt(samples: list[Sample]) -> bool:
    """Two or more samples with no response yet and the same tokens: what one request of vLLM's ``n`` can
    generate (a continued sample has a response of its own length)."""
    return (
        len(samples) > 1
        and all(s.status is Status.PENDING and not s.response_length for s in samples)
        and all(s.tokens == samples[0].tokens for s in samples)
    )


class RolloutWorker:
    def __init__(self, spec: RolloutWorkerSpec, controller):
        self.spec, self.controller = spec, controller
        self.tokenizer = load_tokenizer(spec.hf_checkpoint)
        self.transport = None  # opened by open_queue()
        self.publisher: GroupPublisher | None = None  # finished groups to the queue, several at a time; open_queue()
        self.writer_id, self.lease_id = None, spec.worker_id
        # straw allows one write in flight per store handle: a single writer thread serialises them.
        self.writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self.reward = resolve_reward(spec.reward)
        self.custom_generate = (
            load_hook("--custom-generate-function-path", spec.custom_generate_function_path)
            if spec.custom_generate_function_path
            else None
        )
        self.rollout_fn = (
            load_hook("--rollout-function-path", spec.rollout_function_path) if spec.rollout_function_path else None
        )
        self.dynamic_filter = (
            load_hook(FILTER_FLAG, spec.dynamic_sampling_filter_path) if spec.dynamic_sampling_filter_path else None
        )
        self.all_samples_process = (
            load_hook(ALL_SAMPLES_FLAG, spec.rollout_all_samples_process_path)
            if spec.rollout_all_samples_process_path
            else None
        )
        # --use-opd lives in the algorithm section, which the spec does not carry: read it where hooks do.
        self.use_opd = bool(getattr(spec.args, "use_opd", False))
        self.stats = RolloutWorkerStats()
        self.group_requests_refused = False  # an engine refused a group request's n (above its --max-num-seqs)
        # The queue's volume filled (a straw publish or acceptance failed): the worker stops generating and its
        # run() ends with this error, which stops the run (the driver polls run(): workers/rollout_group.py).
        self.queue_full: DiskFull | None = None
        self.active: dict[str, InFlight] = {}
        # The data source of the --rollout-function-path call in progress: the heartbeat renews its groups' leases.
        self.function_source: LeasedDataSource | None = None
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    def open_queue(self) -> dict[str, str | None]:
        """Open this worker's own handle on the queue and return its identity (worker, lease and writer id).

        Apart from construction so that the driver can start the worker's process (imports, tokenizer, hooks)
        while the trainer starts, and give it a queue writer only after recovery has dealt with the writers
        of earlier workers."""
        if self.transport is None:
            # The fault tests' points in the middle of this worker's writes (None unless a test set one).
            self.transport = make_transport(self.spec.transport, self.spec.store, StrawWriteFaults.if_enabled())
            # Leasing under "<name>@<straw writer id>" lets a later controller find, from the journal
            # alone, the publications this worker left unaccepted if it dies (vime.queue.gc).
            self.writer_id = getattr(self.transport, "writer_id", None)
            self.lease_id = f"{self.spec.worker_id}@{self.writer_id}" if self.writer_id else self.spec.worker_id
            self.publisher = GroupPublisher(self.transport, self.writer)
        return {"worker_id": self.spec.worker_id, "lease_id": self.lease_id, "writer_id": self.writer_id}

    async def run(self) -> RolloutWorkerStats:
        """Lease and generate until stop() (after open_queue()); returns the worker's counters."""
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.session = session
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            try:
                if self.rollout_fn is not None:
                    await self._custom_rollout_loop()
                while not self._stopping.is_set():
                    free = self._free_group_slots()
                    if free <= 0:  # every slot taken: a group finishing frees one
                        await asyncio.sleep(0.02)
                        continue
                    # Where nothing is admissible, the controller holds the call until something may be.
                    leased = await self.controller.lease_or_wait.remote(self.lease_id, free, LEASE_WAIT_SECONDS)
                    if self._stopping.is_set():  # stop() came while the call waited: the groups go back untouched
                        for item in leased:
                            await self._give_back(item.assignment)
                        break
                    for item in leased:
                        task = asyncio.create_task(self._process(item))
                        self.active[item.assignment.task.task_id] = InFlight(task, item.assignment.lease)
                        task.add_done_callback(lambda _t, key=item.assignment.task.task_id: self.active.pop(key, None))
            finally:
                await self._drain_active()
                heartbeat.cancel()
        if self.queue_full is not None:
            raise self.queue_full
        return self.stats

    def _free_group_slots(self) -> int:
        """How many more groups to lease now.

        --rollout-max-concurrent-groups bounds the groups generating: a generated group waiting for its
        publication and acceptance sends no request, so it leaves its slot to the next group. An engine
        finishes a batch's requests nearly together; while that burst of groups is written one by one (one
        straw publication and one acceptance each), the engines would otherwise wait for new requests
        (bench/rollout's demo shape: (c) 1.15x once they no longer did). The groups ending are bounded as well (as
        many again), so a queue slower than generation cannot pile them up in this worker's memory."""
        limit = self.spec.max_concurrent_groups
        generating = sum(1 for entry in self.active.values() if entry.phase is GroupPhase.GENERATING)
        return min(limit - generating, 2 * limit - len(self.active))

    async def stop(self) -> None:
        self._stopping.set()

    def get_stats(self) -> RolloutWorkerStats:
        if self.publisher is not None:
            self.stats.queue_publications = self.publisher.publications
        return self.stats

    async def _drain_active(self) -> None:
        """Shutdown: groups in flight end as continuations with their prefixes (the driver aborts the
        engines' requests after stop(), so they return at once); whatever does not end within the
        request timeout goes back to the queue without a prefix. No prompt is lost either way."""
        tasks = [entry.task for entry in self.active.values()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.spec.request_timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self.active.clear()

    async def _heartbeat_loop(self) -> None:
        interval = max(0.5, self.spec.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._heartbeat()
            except Exception:  # a heartbeat loop that ended here would let every later lease expire
                logger.exception("renewing this worker's leases failed; trying again in %.1f s", interval)

    async def _heartbeat(self) -> None:
        """Renew the leases of the groups in flight and cancel the groups still generating whose lease is no
        longer current. A group past generation is left alone: its acceptance may have ended its lease while
        this heartbeat was on its way (at 256 stand-in engines an accepted group was logged as dropped and
        counted discarded), and its own call to the controller says whether it was still current.

        The groups a --rollout-function-path call holds are renewed too (a call may take longer than
        --rollout-queue-lease-seconds: a multi-turn agent's, say); they cannot be cancelled, as the user's
        function runs in a thread, and one whose lease was lost is discarded when the function returns it."""
        items = list(self.active.items())
        source = self.function_source
        held = source.held_leases() if source is not None else []
        if not items and not held:
            return
        current = await self.controller.heartbeat.remote([entry.lease for _, entry in items] + held)
        for (task_id, entry), ok in zip(items, current):
            if ok or entry.phase is GroupPhase.ENDING or entry.task.done():
                continue
            logger.warning("lease of %s is no longer current; dropping its group", task_id)
            self.stats.groups_discarded += 1
            entry.task.cancel()
        lost = len(held) - sum(current[len(items) :])
        if lost and source.phase is GroupPhase.GENERATING:
            logger.warning(
                "%d lease(s) of the groups --rollout-function-path holds are no longer current; the function's "
                "groups of them will be discarded when it returns them",
                lost,
            )

    # ------------------------------------------------------------------ --rollout-function-path
    async def _custom_rollout_loop(self) -> None:
        """Call the user's generate_rollout(args, rollout_id, data_source) until stopped.

        ``data_source.get_samples(n)`` leases n prompts from the queue (blocking until admitted);
        each group the function returns is published and accepted under its lease, exactly like a
        group of the built-in rollout; leased groups it does not return go back to the queue.
        """
        rollout_id = 0
        while not self._stopping.is_set():
            # A test may keep this worker from leasing (VIME_FAULT_HOLDS "rollout.before_call", by call number) while
            # another one must get the prompts; it holds no lease meanwhile.
            while faults.held("rollout.before_call", rollout_id + 1) and not self._stopping.is_set():
                await asyncio.sleep(0.05)
            source = self.function_source = LeasedDataSource(self)
            try:
                await self._one_rollout_call(source, rollout_id)
            finally:
                self.function_source = None
            rollout_id += 1

    async def _one_rollout_call(self, source: LeasedDataSource, rollout_id: int) -> None:
        """One call of the user's function; its groups published and accepted, the others given back."""
        output = await asyncio.to_thread(self.rollout_fn, self.spec.args, rollout_id, source)
        source.phase = GroupPhase.ENDING
        fault_point("rollout.mid_generation")
        groups = output.samples if isinstance(output, RolloutFnTrainOutput) else output
        returned = set()
        for group in groups or []:
            item = source.leased.get(group[0].group_index) if group else None
            if item is None:
                raise ValueError(
                    "--rollout-function-path: a returned group does not come from "
                    "data_source.get_samples (unknown group_index)"
                )
            returned.add(group[0].group_index)
            try:
                await self._finish_group(item, group)
            except Exception as error:
                returned.discard(group[0].group_index)  # not accepted: back with the rest
                if self._stop_if_the_queue_is_full(error):
                    break
                if not isinstance(error, InfrastructureFault):
                    raise  # an error of the user's rollout function's group ends the worker, as always
                self._count_infrastructure_fault(item.assignment, error)  # back to the queue, as a built-in group
        for group_index, item in source.leased.items():
            if group_index not in returned:
                await self._give_back(item.assignment)

    # ------------------------------------------------------------------ one group
    def _fresh_group(self, item) -> list[Sample]:
        task, prompt = item.assignment.task, item.prompt
        tokens = render_prompt(
            self.tokenizer,
            prompt.prompt,
            apply_chat_template=self.spec.apply_chat_template,
            chat_template_kwargs=self.spec.apply_chat_template_kwargs,
        )
        # One session per sample: every request of it (each turn of a multi-turn custom generate,
        # a continuation after a weight update) carries this id as x-session-id (vime.rollout.generate).
        return [
            Sample(
                group_index=task.group_index,
                index=i,
                prompt_index=task.prompt_index,
                prompt=prompt.prompt,
                label=prompt.label,
                tokens=list(tokens),
                metadata=dict(prompt.metadata),
                source=prompt.source,
                session_id=f"{task.task_id}-{i}",
            )
            for i in range(self.spec.n_samples_per_prompt)
        ]

    async def _generate_one(self, sample: Sample) -> Sample:
        if self._stopping.is_set():
            return sample  # draining: not started, stays PENDING and goes back with the group
        try:
            if self.custom_generate is not None:
                result = await call_maybe_async(
                    self.custom_generate, self.spec.args, sample, self.spec.sampling.as_dict()
                )
                if not isinstance(result, Sample):
                    raise TypeError(
                        f"--custom-generate-function-path {self.spec.custom_generate_function_path} "
                        f"returned {type(result).__name__}; it must return the Sample"
                    )
                return result
            if sends_request(sample, self.spec.sampling):
                self.stats.generate_requests += 1
            return await generate(
                self.session, self.spec.router_url, sample, self.spec.sampling, timeout=self.spec.request_timeout
            )
        except GenerateError as error:
            await self._engine_failed(error)
            if self.custom_generate is not None:
                # A custom generator may have changed the sample before the failing turn: regenerate it
                # from its prompt rather than trust a half-updated state.
                raise InfrastructureFault(
                    f"an engine failed a turn of --custom-generate-function-path: {error}"
                ) from error
            return sample

    async def _generate_group(self, samples: list[Sample]) -> None:
        """--rollout-group-requests: the group's fresh samples in one request (vime.rollout.generate)."""
        if self._stopping.is_set():
            return  # draining: not started, they stay PENDING and go back with the group
        try:
            if sends_request(samples[0], self.spec.sampling):
                self.stats.generate_requests += 1
            await generate_group(
                self.session, self.spec.router_url, samples, self.spec.sampling, timeout=self.spec.request_timeout
            )
        except GenerateError as error:
            if not refused_for_n(error):
                await self._engine_failed(error)
                return
            # More samples a prompt than the engine runs at once: no fault of the group's (no attempt spent).
            # This worker asks one request per sample from now on, and says so once.
            if not self.group_requests_refused:
                self.group_requests_refused = True
                logger.warning(
                    "--rollout-group-requests: the engine refused %d samples in one request (%s); this rollout "
                    "worker sends one request per sample from now on",
                    len(samples),
                    error,
                )
            await asyncio.gather(*(self._generate_one(s) for s in samples))

    def _one_request_for(self, samples: list[Sample]) -> bool:
        """Whether ``samples`` are asked for in one request: --rollout-group-requests (start-up validation left out
        per-sample seeds, custom generate functions and routing replay), unless an engine refused it, and
        :func:`fresh_samples_of_one_prompt`."""
        return self.spec.group_requests and not self.group_requests_refused and fresh_samples_of_one_prompt(samples)

    async def _engine_failed(self, error: GenerateError) -> None:
        """An engine failed, hung, refused the route or was removed (docs/elastic.md): that is no fault of the
        samples', so it spends no attempt of their task. They keep what they had and their group returns to the
        queue as a continuation, to be resumed on another engine; the engine's own health probes quarantine it.
        The pause keeps a router without engines from spinning us. Any other error is the group's: raised."""
        if not error.engine_fault:
            raise error
        self.stats.engine_errors += 1
        self.stats.last_engine_error = f"GenerateError: {error}"
        await asyncio.sleep(ENGINE_RETRY_SECONDS)

    def _restart(self, sample: Sample) -> None:
        """Forget an aborted sample's partial response (without --partial-rollout)."""
        del sample.tokens[sample.prompt_length :]
        sample.response_length, sample.weight_versions = 0, []
        sample.rollout_log_probs, sample.loss_mask = None, None
        sample.status = Status.PENDING

    async def _process(self, item) -> None:
        assignment = item.assignment
        lease = assignment.lease
        try:
            if assignment.partial is None:
                samples = self._fresh_group(item)
            else:
                samples = await asyncio.get_running_loop().run_in_executor(
                    self.writer, self.transport.read, assignment.partial
                )
                for sample in samples:
                    sample.prompt = item.prompt.prompt  # not stored with the records: the dataset has it
            for sample in samples:
                if sample.status is Status.ABORTED and not self.spec.partial_rollout:
                    self._restart(sample)  # a continuation keeps its prefix only with --partial-rollout
            unfinished = [s for s in samples if s.status in (Status.PENDING, Status.ABORTED)]
            if self._one_request_for(unfinished):
                await self._generate_group(unfinished)
            else:
                await asyncio.gather(*(self._generate_one(s) for s in unfinished))
            if (entry := self.active.get(assignment.task.task_id)) is not None:
                entry.phase = GroupPhase.ENDING
            fault_point("rollout.mid_generation")
            aborted = sum(s.status is Status.ABORTED for s in samples)
            if aborted or any(s.status is Status.PENDING for s in samples):
                # A weight update (flush), a failed engine or shutdown interrupted the group: it goes back
                # to the queue as a continuation with everything generated so far; with nothing generated
                # (an engine that failed every request at once) it goes back as it came, nothing written.
                self.stats.samples_aborted += aborted
                if assignment.partial is None and not any(s.response_length for s in samples):
                    await self.controller.return_partial.remote(lease, assignment.task, None)
                    return
                await self._yield_continuation(item, samples)
                return
            await self._finish_group(item, samples)
        except asyncio.CancelledError:
            await self.controller.return_partial.remote(lease, assignment.task, None)
            raise
        except Exception as error:  # noqa: BLE001 - sorted out by _group_failed
            await self._group_failed(assignment, error)

    def _stop_if_the_queue_is_full(self, error: Exception) -> bool:
        """Whether ``error`` says that the queue's volume is full; if so the worker stops generating, and its
        run() ends with the stop (no attempt of the group's prompt is spent)."""
        full = (
            self.spec.queue_volume.full_error("a rollout worker's straw publish or acceptance of a group", error)
            if self.spec.queue_volume
            else None
        )
        if full is None:
            return False
        logger.error("%s", full)
        self.queue_full = self.queue_full or full
        self._stopping.set()
        return True

    async def _give_back(self, assignment) -> None:
        """The group goes back to the queue, untouched. Once the queue's volume is full its journal may refuse
        that (and every other call): the lease then expires, and the resumed run generates the group again."""
        try:
            await self.controller.return_partial.remote(assignment.lease, assignment.task, None)
        except Exception:
            if self.queue_full is None:
                raise

    async def _group_failed(self, assignment, error: Exception) -> None:
        """What a group's failure costs: nothing for a full queue volume (the worker stops, and the run with
        it) nor for an infrastructure fault (back to the queue); an attempt of its task for the sample's own
        fault (a reward, a hook, a response)."""
        lease = assignment.lease
        if self._stop_if_the_queue_is_full(error):
            await self._give_back(assignment)
        elif isinstance(error, InfrastructureFault):  # not the sample's fault: back to the queue, no attempt spent
            self._count_infrastructure_fault(assignment, error)
            await self.controller.return_partial.remote(lease, assignment.task, None)
            await asyncio.sleep(ENGINE_RETRY_SECONDS)  # its slot stays taken a moment: no hot loop
        else:
            self.stats.errors += 1
            self.stats.last_error = f"{type(error).__name__}: {error}"
            logger.error("group %s failed: %s", assignment.task.task_id, self.stats.last_error)
            await self.controller.fail.remote(lease, self.stats.last_error)

    def _count_infrastructure_fault(self, assignment, error: Exception) -> None:
        self.stats.engine_errors += 1
        self.stats.last_engine_error = f"{error}"
        logger.error("group %s returned to the queue: %s", assignment.task.task_id, error)

    async def _yield_continuation(self, item, samples: list[Sample]) -> None:
        assignment = item.assignment
        lease = assignment.lease
        versions = [v for s in samples for v in s.weight_versions]
        task = assignment.task.as_continuation(min(versions, default=item.version))
        submission_id = partial_submission_id(lease.task_id, lease.attempt_id)
        ref = await asyncio.get_running_loop().run_in_executor(
            self.writer,
            lambda: self.transport.publish(
                samples, task_id=lease.task_id, attempt_id=lease.attempt_id, submission_id=submission_id
            ),
        )
        async with self._unless_answered(ref):
            returned = await self.controller.return_partial.remote(lease, task, ref)
        if returned:
            self.stats.groups_yielded += 1
        else:  # the lease moved on meanwhile
            await self._discard(ref)
            self.stats.groups_discarded += 1

    async def _finish_group(self, item, samples: list[Sample]) -> None:
        """Score (unless already scored), filter, add the OPD teacher's log-probs, publish the payload, and
        have the controller accept it."""
        lease = item.assignment.lease
        for sample in samples:
            if not sample.response:
                sample.response = self.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
            if len(sample.weight_versions) != sample.response_length:
                # A custom generator that does not record versions: its tokens come from the
                # weights current when the prompt was leased.
                sample.weight_versions = [item.version] * sample.response_length
        if any(s.reward is None for s in samples):
            await self.reward.score_group(self.spec.args, samples)
        verdict = None
        if self.dynamic_filter is not None:
            verdict = interpret_filter(
                await call_maybe_async(self.dynamic_filter, self.spec.args, samples),
                self.spec.dynamic_sampling_filter_path,
            )
        if self.all_samples_process is not None:
            # The reference's process(args, all_samples, data_source): here once per scored group, kept or
            # filtered; prompts are leased one group at a time from the queue, so there is no data source.
            await call_maybe_async(self.all_samples_process, self.spec.args, [samples], None)
        if verdict is not None and not verdict.keep:
            await self._reject_group(item, verdict.reason)
            return
        if self.use_opd:
            await self._attach_teacher(samples)
        submission_id = group_submission_id(lease.task_id, lease.attempt_id)
        try:
            ref = await self.publisher.publish(GroupToPublish(samples, lease.task_id, lease.attempt_id, submission_id))
        except Exception as error:
            raise InfrastructureFault(
                f"publishing group {lease.task_id} to the queue failed: {type(error).__name__}: {error}"
            ) from error
        fault_point("rollout.after_publish")  # payload durable, not yet accepted
        tokens = sum(s.response_length for s in samples)
        min_version = min((v for s in samples for v in s.weight_versions), default=item.version)
        async with self._unless_answered(ref):
            position = await self.controller.complete.remote(
                lease, submission_id, ref, len(samples), tokens, min_version
            )
        if position is None:  # the lease moved on: this payload will never be referenced
            await self._discard(ref)
            self.stats.groups_discarded += 1
        else:
            self.stats.groups_accepted += 1
            self.stats.response_tokens += tokens

    async def _discard(self, ref) -> None:
        """Give up a payload this worker published (on its writer thread: one straw write at a time per handle)."""
        await asyncio.get_running_loop().run_in_executor(self.writer, self.transport.discard, ref)

    @contextlib.asynccontextmanager
    async def _unless_answered(self, ref) -> AsyncIterator[None]:
        """The call to the controller that hands ``ref`` over (an acceptance, a continuation): when it raises (the
        controller lost, the group cancelled), the worker gives its hold on the payload up before the error goes on.
        Whether or not the queue took it, nothing it owns is freed (straw: a publication adopted is the queue's), and
        a payload it did not take is never left behind by a worker that lives on: the reaping of a dead writer only
        looks at what its last calls may have left (queue/gc.py)."""
        try:
            yield
        except BaseException:
            try:
                await self._discard(ref)
            except Exception as error:  # noqa: BLE001 - the call's own error is the one to report
                logger.warning("could not give up the payload of an unanswered call (%s); the reaping will", error)
            raise

    async def _attach_teacher(self, samples: list[Sample]) -> None:
        """--use-opd: the teacher's log-probs of the samples that have none yet. After the dynamic filter,
        so that dropped groups cost the teacher nothing; a reward or rollout hook that attached them
        itself is not repeated. A teacher that keeps failing fails the group (TeacherError naming its URL)."""
        missing = [s for s in samples if s.teacher_log_probs is None]
        if missing:
            await attach_teacher_log_probs(
                self.spec.args, missing, http=self.session, timeout=self.spec.request_timeout
            )

    async def _reject_group(self, item, reason: str) -> None:
        """A group the dynamic filter dropped: its task ends as *rejected* in the queue (journaled
        with the reason; never trained, not regenerated). Nothing is published."""
        if await self.controller.reject.remote(item.assignment.lease, reason):
            self.stats.groups_rejected += 1
            self.stats.rejected_reasons[reason] = self.stats.rejected_reasons.get(reason, 0) + 1
        else:  # the lease moved on meanwhile: another attempt owns the prompt now
            self.stats.groups_discarded += 1


class LeasedDataSource:
    """The ``data_source`` a custom rollout function receives: prompts leased from the queue."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self.leased: dict[int, object] = {}  # group index -> LeasedPrompt; written by the function's thread
        self.phase = GroupPhase.GENERATING  # ENDING once the function returned
        self._lock = threading.Lock()  # the heartbeat reads the leases on the worker's event loop meanwhile

    def held_leases(self) -> list:
        with self._lock:
            return [item.assignment.lease for item in self.leased.values()]

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Up to ``num_samples`` groups of --n-samples-per-prompt fresh samples.

        Blocks until at least one prompt is admitted, then takes what the staleness bound admits
        within a short grace period: insisting on all of them could wait on the trainer, which
        waits on these very groups.
        """
        import ray

        groups: list[list[Sample]] = []
        grace_until = None
        while len(groups) < num_samples and not self.worker._stopping.is_set():
            # The controller holds the call while nothing is admissible (Controller.lease_or_wait), within the grace
            # period only until it ends.
            wait = LEASE_WAIT_SECONDS if grace_until is None else max(0.0, grace_until - time.monotonic())
            lease = self.worker.controller.lease_or_wait.remote(self.worker.lease_id, num_samples - len(groups), wait)
            for item in ray.get(lease):
                with self._lock:
                    self.leased[item.assignment.task.group_index] = item
                groups.append(self.worker._fresh_group(item))
            if groups and grace_until is None:
                grace_until = time.monotonic() + GET_SAMPLES_GRACE_SECONDS
            if grace_until is not None and time.monotonic() >= grace_until:
                break
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Unfinished groups go back to the queue (they are regenerated from the prompt)."""
        import ray

        for group in samples:
            with self._lock:
                item = self.leased.pop(group[0].group_index, None)
            if item is not None:
                ray.get(self.worker.controller.return_partial.remote(item.assignment.lease, item.assignment.task, None))
