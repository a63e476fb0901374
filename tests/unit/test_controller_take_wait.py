"""Controller.take_groups_or_wait: the driver's call for a step's groups waits in the controller until the last one
is accepted, instead of the driver asking take_groups and stats every 50 ms (vime/train.py, wait_for_groups).

The controller's calls run here on one asyncio loop, as Ray runs them on the actor's: the waiting take and the
rollout worker's complete() interleave only where the take waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.controller_spec import controller_spec, write_prompts
from tests.unit.test_controller_queue import publish
from vime.workers.controller import Controller


def accept(controller: Controller, tmp_path, leased) -> int:
    """Publish ``leased``'s group and have the controller accept it, as a rollout worker does."""
    submission, ref = publish(tmp_path, "straw", leased)
    return controller.complete(leased.assignment.lease, submission, ref, 2, 2, 0)


@pytest.fixture
def leased(tmp_path):
    """A controller (2 groups a rollout) with one rollout's two groups leased, none accepted yet; its folder."""
    controller = Controller(controller_spec(tmp_path, write_prompts(tmp_path, 16), groups_per_rollout=2))
    items = controller.lease("w", 2)
    assert len(items) == 2
    yield controller, tmp_path, items
    controller.shutdown()


def test_a_step_s_groups_already_accepted_are_taken_at_once(leased):
    controller, folder, items = leased
    for item in items:
        accept(controller, folder, item)
    started = time.monotonic()
    taken = asyncio.run(controller.take_groups_or_wait(0, 2, 0, 0, wait_seconds=30.0))
    assert [g.position for g in taken.groups] == [0, 1] and taken.next_cursor == 2
    assert time.monotonic() - started < 5.0


def test_a_take_waits_for_the_step_s_last_group_and_returns_when_it_is_accepted(leased):
    controller, folder, (first, second) = leased
    accept(controller, folder, first)

    async def scenario():
        waiting = asyncio.create_task(controller.take_groups_or_wait(0, 2, 0, 0, wait_seconds=30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # one group of two: the call waits (an acceptance of the first woke nothing)
        accepted_at = time.monotonic()
        accept(controller, folder, second)
        taken = await asyncio.wait_for(waiting, 10.0)
        return taken, time.monotonic() - accepted_at

    taken, latency = asyncio.run(scenario())
    assert [g.position for g in taken.groups] == [0, 1]
    assert latency < 5.0, latency  # woken by the acceptance (a loaded machine's seconds, not the 30 s wait)


def test_a_take_that_finds_too_few_groups_returns_none_after_its_wait(leased):
    controller, folder, (first, _) = leased
    accept(controller, folder, first)
    started = time.monotonic()
    taken = asyncio.run(controller.take_groups_or_wait(0, 2, 0, 0, wait_seconds=0.4))
    assert taken.groups == [] and taken.skipped == [] and taken.next_cursor == 0
    assert time.monotonic() - started >= 0.4
    # Nothing was taken: the same call with the count that exists takes the one group.
    assert [g.position for g in controller.take_groups(0, 1, 0, 0).groups] == [0]
