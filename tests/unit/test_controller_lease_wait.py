"""Controller.lease_or_wait: a lease the staleness bound refuses waits in the controller for a call that may admit
it, instead of the rollout worker asking again every 20 ms (workers/rollout_worker.py).

The controller's calls run here on one asyncio loop, as Ray runs them on the actor's: the waiting lease and the
driver's sync() interleave only where the lease waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.controller_spec import controller_spec, write_prompts
from vime.workers import controller as controller_module
from vime.workers.controller import Controller


@pytest.fixture
def blocked(tmp_path):
    """A controller whose staleness bound admits nothing more: 2 groups a rollout, bound 0, both leased."""
    controller = Controller(controller_spec(tmp_path, write_prompts(tmp_path, 16), max_staleness=0))
    assert len(controller.lease("w", 10)) == 2
    assert controller.lease("w", 10) == []
    yield controller
    controller.shutdown()


def test_a_lease_that_can_be_served_returns_at_once(tmp_path):
    controller = Controller(controller_spec(tmp_path, write_prompts(tmp_path, 16)))
    started = time.monotonic()
    leased = asyncio.run(controller.lease_or_wait("w", 3, 30.0))
    assert len(leased) == 3 and time.monotonic() - started < 5.0
    controller.shutdown()


def test_a_refused_lease_is_served_as_soon_as_a_trained_step_admits_it(blocked, monkeypatch):
    monkeypatch.setattr(controller_module, "LEASE_RECHECK_SECONDS", 60.0)  # only sync() can wake it in time

    async def scenario():
        waiting = asyncio.create_task(blocked.lease_or_wait("w", 10, 30.0))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the bound still holds: the call waits
        admitted_at = time.monotonic()
        blocked.sync(1, 2, 2)  # the driver: both groups trained, the engines serve version 1
        leased = await asyncio.wait_for(waiting, 10.0)
        return leased, time.monotonic() - admitted_at

    leased, latency = asyncio.run(scenario())
    assert len(leased) == 2  # the next rollout's groups
    assert latency < 5.0, latency  # woken by sync() (a loaded machine's seconds, not the minute of a look)


def test_a_refused_lease_looks_again_by_itself_for_what_no_call_announces(blocked, monkeypatch):
    """The bound opening without a controller call (here: its state changed behind its back, as an expired lease
    changes the queue's) is found by the periodic look."""
    monkeypatch.setattr(controller_module, "LEASE_RECHECK_SECONDS", 0.05)

    async def scenario():
        waiting = asyncio.create_task(blocked.lease_or_wait("w", 10, 30.0))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        blocked.trained = blocked.consumed = 2  # as sync(1, 2, 2) would, but without announcing it
        blocked.weight_version = 1
        return await asyncio.wait_for(waiting, 10.0)

    assert len(asyncio.run(scenario())) == 2


def test_a_refused_lease_returns_nothing_after_its_wait(blocked):
    started = time.monotonic()
    assert asyncio.run(blocked.lease_or_wait("w", 10, 0.4)) == []
    assert time.monotonic() - started >= 0.4
