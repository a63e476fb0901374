"""The rollout worker's heartbeat and group slots against a real controller and straw queue: a group whose lease
is lost while it generates is cancelled and counted discarded; a group whose acceptance ends its lease while a
heartbeat is on its way is counted accepted, once, and never cancelled (bench/scale at 256 stand-in engines
logged such groups as dropped, although the controller had accepted and the trainer trained them); a group
waiting for its acceptance no longer holds one of --rollout-max-concurrent-groups' slots.

Stand-ins, each because what it stands for is not what is tested: the Ray actor handle (``ControllerHandle``:
``method.remote(...)`` awaits the real ``Controller``'s method, which is what Ray's handle does across
processes), a character-level tokenizer (the worker only renders a string prompt with it), and a
``--custom-generate-function-path`` hook instead of an engine (the public way to generate without one)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import types

import pytest

from tests.controller_spec import controller_spec, write_prompts
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import make_transport
from vime.sample import Status
from vime.workers.controller import Controller
from vime.workers.group_publisher import GroupPublisher
from vime.workers.rollout_worker import GroupPhase, InFlight, RolloutWorker, RolloutWorkerStats


class ControllerHandle:
    """``handle.method.remote(*args)`` awaits the real controller's method; ``hold_complete`` makes an acceptance's
    reply wait (the acceptance itself is done) until ``release`` is set."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.hold_complete = False
        self.accepted = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name):
        method = getattr(self.controller, name)

        async def call(*args):
            result = method(*args)
            if asyncio.iscoroutine(result):  # Controller.lease_or_wait
                result = await result
            if name == "complete" and self.hold_complete:
                self.accepted.set()
                await self.release.wait()
            return result

        return types.SimpleNamespace(remote=call)


def char_tokenizer(text, add_special_tokens=False):
    return {"input_ids": [ord(c) for c in text]}


@pytest.fixture
def queue(tmp_path):
    spec = controller_spec(tmp_path, write_prompts(tmp_path, 4), num_epoch=1, groups_per_rollout=1, max_staleness=0)
    controller = Controller(spec)
    yield controller, spec.store
    controller.shutdown()


def worker_on(handle: ControllerHandle, store: StoreOptions, generate) -> RolloutWorker:
    worker = RolloutWorker.__new__(RolloutWorker)
    worker.spec = types.SimpleNamespace(
        args=types.SimpleNamespace(),
        partial_rollout=False,
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        n_samples_per_prompt=2,
        sampling=types.SimpleNamespace(as_dict=dict),
        custom_generate_function_path="test:generate",
        group_requests=False,
        queue_volume=None,
    )
    worker.tokenizer = char_tokenizer
    worker.custom_generate = generate
    worker.reward = worker.dynamic_filter = worker.all_samples_process = None
    worker.use_opd = False
    worker.stats = RolloutWorkerStats()
    worker.active = {}
    worker.function_source = None
    worker._stopping = asyncio.Event()
    worker.writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    worker.transport = make_transport("straw", store)
    worker.publisher = GroupPublisher(worker.transport, worker.writer)
    worker.controller = handle
    worker.queue_full = None
    return worker


def answered(sample):
    sample.tokens = sample.tokens + [7]
    sample.response_length, sample.response, sample.reward = 1, "7", 1.0
    sample.status = Status.COMPLETED
    return sample


def start(worker: RolloutWorker, item) -> asyncio.Task:
    """As ``RolloutWorker.run`` starts a leased group."""
    task = asyncio.create_task(worker._process(item))
    key = item.assignment.task.task_id
    worker.active[key] = InFlight(task, item.assignment.lease)
    task.add_done_callback(lambda _t: worker.active.pop(key, None))
    return task


def test_a_group_accepted_while_a_heartbeat_is_on_its_way_counts_once_as_accepted(queue):
    controller, store = queue

    async def scenario():
        handle = ControllerHandle(controller)
        handle.hold_complete = True

        async def generate(args, sample, sampling):
            return answered(sample)

        worker = worker_on(handle, store, generate)
        (item,) = controller.lease("w", 1)
        task = start(worker, item)
        await asyncio.wait_for(handle.accepted.wait(), 30)  # accepted; the reply not back yet
        entry = worker.active[item.assignment.task.task_id]
        assert entry.phase is GroupPhase.ENDING
        assert controller.heartbeat([item.assignment.lease]) == [False]  # the acceptance ended the lease
        await worker._heartbeat()
        assert not task.cancelled() and worker.stats.groups_discarded == 0
        handle.release.set()
        await asyncio.wait_for(task, 30)
        worker.transport.close()
        return worker.stats

    stats = asyncio.run(scenario())
    assert (stats.groups_accepted, stats.groups_discarded) == (1, 0)
    assert controller.stats().accepted == 1


def test_a_group_whose_lease_is_lost_while_it_generates_is_cancelled_and_counted_discarded(queue):
    controller, store = queue

    async def scenario():
        handle = ControllerHandle(controller)
        generating, never = asyncio.Event(), asyncio.Event()

        async def generate(args, sample, sampling):
            generating.set()
            await never.wait()  # an engine that has not answered yet
            return answered(sample)

        worker = worker_on(handle, store, generate)
        (item,) = controller.lease("w", 1)
        task = start(worker, item)
        await asyncio.wait_for(generating.wait(), 30)
        assert worker.active[item.assignment.task.task_id].phase is GroupPhase.GENERATING
        assert controller.return_partial(item.assignment.lease, item.assignment.task, None)  # lease moved on
        await worker._heartbeat()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        worker.transport.close()
        return worker.stats

    stats = asyncio.run(scenario())
    assert (stats.groups_accepted, stats.groups_discarded) == (0, 1)
    assert controller.stats().accepted == 0


def test_a_failed_heartbeat_does_not_end_the_renewals(queue):
    controller, store = queue

    async def scenario():
        handle = ControllerHandle(controller)
        calls = []

        def heartbeat(leases):
            calls.append(len(leases))
            if len(calls) == 1:
                raise RuntimeError("the controller's answer was lost")
            return controller.heartbeat(leases)

        handle.heartbeat = types.SimpleNamespace(remote=lambda leases: asyncio.sleep(0, heartbeat(leases)))
        generating, never = asyncio.Event(), asyncio.Event()

        async def generate(args, sample, sampling):
            generating.set()
            await never.wait()
            return answered(sample)

        worker = worker_on(handle, store, generate)
        worker.spec.lease_seconds = 1  # a heartbeat every 0.5 s
        (item,) = controller.lease("w", 1)
        task = start(worker, item)
        await asyncio.wait_for(generating.wait(), 30)
        loop = asyncio.create_task(worker._heartbeat_loop())
        for _ in range(100):
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.1)
        loop.cancel()
        task.cancel()
        await asyncio.gather(loop, task, return_exceptions=True)
        worker.transport.close()
        return calls

    assert asyncio.run(scenario())[:2] == [1, 1]  # the first call failed, the loop went on renewing


def test_a_generated_group_waiting_for_its_acceptance_leaves_its_slot_to_the_next_group(tmp_path):
    """--rollout-max-concurrent-groups bounds the groups generating: with a limit of 1, the next group starts
    while the first one's acceptance is still on its way (before, the engines waited for it); the groups
    ending are bounded too, as many again: two groups waiting for their acceptance hold back a third."""
    # The controller admits all four groups at once: only the worker's bound is tested.
    spec = controller_spec(tmp_path, write_prompts(tmp_path, 4), num_epoch=1, groups_per_rollout=4, max_staleness=0)
    controller = Controller(spec)
    store = spec.store

    async def scenario():
        handle = ControllerHandle(controller)
        handle.hold_complete = True
        started: list[str] = []
        second_may_end = asyncio.Event()

        async def generate(args, sample, sampling):
            started.append(sample.prompt)
            if sample.prompt != "000=":
                await second_may_end.wait()
            return answered(sample)

        async def until(condition, what):
            for _ in range(300):
                if condition():
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"timed out waiting for {what}; generated so far: {started}")

        worker = worker_on(handle, store, generate)
        worker.spec.max_concurrent_groups = 1
        worker.spec.lease_seconds = 60
        worker.spec.request_timeout = 30
        worker.rollout_fn, worker.lease_id = None, "w"
        running = asyncio.create_task(worker.run())
        await asyncio.wait_for(handle.accepted.wait(), 30)  # group 0 accepted, the reply held
        await until(lambda: "001=" in started, "the second group to start while the first is being accepted")
        second_may_end.set()
        await until(
            lambda: len(worker.active) == 2 and all(e.phase is GroupPhase.ENDING for e in worker.active.values()),
            "both groups to wait for their acceptance",
        )
        await asyncio.sleep(0.5)  # the worker's loop runs every 20 ms meanwhile
        assert "002=" not in started, "a third group started while two waited for their acceptance"
        handle.release.set()
        await until(lambda: controller.stats().accepted == 4, "all four groups to be accepted")
        await worker.stop()
        await asyncio.wait_for(running, 30)
        worker.transport.close()
        return worker.stats

    try:
        stats = asyncio.run(scenario())
    finally:
        controller.shutdown()
    assert (stats.groups_accepted, stats.groups_discarded) == (4, 0)


class ControllerLost(RuntimeError):
    """What a call raises when the controller's process is gone (Ray's RayActorError), here by the handle."""


@pytest.mark.parametrize("accepted", [False, True], ids=["call-lost", "reply-lost"])
def test_a_payload_whose_acceptance_went_unanswered_is_given_up_by_its_worker(queue, accepted):
    """The acceptance call raises: before the controller saw it, or after it accepted the group (the reply lost). The
    worker gives its hold on the payload up either way, so that nothing it published waits for the reaping of a
    writer that lives on (queue/gc.py looks only at a dead writer's last calls); an accepted group stays whole."""
    controller, store = queue

    class LosingHandle(ControllerHandle):
        def __getattr__(self, name):
            if name != "complete":
                return super().__getattr__(name)

            async def call(*args):
                if accepted:
                    self.controller.complete(*args)
                raise ControllerLost("the controller's actor died")

            return types.SimpleNamespace(remote=call)

    async def scenario():
        async def generate(args, sample, sampling):
            return answered(sample)

        worker = worker_on(LosingHandle(controller), store, generate)
        given_up = []
        real_discard = worker.transport.discard

        def discard(ref):
            given_up.append(ref)
            real_discard(ref)

        worker.transport.discard = discard
        (item,) = controller.lease("w", 1)
        await asyncio.wait_for(start(worker, item), 30)
        worker.transport.close()
        return worker.stats, given_up

    stats, given_up = asyncio.run(scenario())
    assert len(given_up) == 1 and stats.errors == 1 and "the controller's actor died" in stats.last_error
    assert controller.stats().accepted == int(accepted)
    if accepted:
        (group,) = controller.take_groups(0, 1, 0, 0, allow_partial=True).groups
        assert group.ref.digest == given_up[0].digest
        assert len(list(controller.queue.store.read(group.ref))) > 0  # still the queue's, whole
