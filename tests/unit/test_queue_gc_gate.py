"""queue/gc.py's wait for a dead writer's gate. The real case (a SIGKILLed writer whose JuiceFS lock is let go a
moment late) is timing-dependent; it is the fault test tests/faults/test_fault_injection.py
::test_rollout_workers_and_the_controller_killed_mid_run_are_replaced_and_every_prompt_trains_once[juicefs] (its
kill in the middle of a generation). Here a stand-in store, which only says WriterBusy a given number of times,
pins down the rule: wait while busy, give up at the deadline."""

import time

import pytest
from straw.errors import WriterBusy

from vime.queue.gc import publication_receipt


class GateHeldFor:
    """Answers straw's publication_receipt with WriterBusy ``times`` times, then with ``refs``."""

    def __init__(self, times: int, refs: list):
        self.times, self.refs, self.calls = times, refs, []

    def publication_receipt(self, writer, api, submission_id):
        self.calls.append((writer, api, submission_id))
        if len(self.calls) <= self.times:
            raise WriterBusy("Writer still holds its mutation gate")
        return self.refs


def test_a_gate_held_a_moment_is_waited_for():
    store = GateHeldFor(3, ["ref"])
    assert publication_receipt(store, "w", "t-a", time.monotonic() + 5, poll=0.01) == ["ref"]
    assert store.calls == [("w", "publish", "t-a")] * 4


def test_a_gate_held_past_the_deadline_raises():
    store = GateHeldFor(10**6, ["ref"])
    started = time.monotonic()
    with pytest.raises(WriterBusy):
        publication_receipt(store, "w", "t-a", started + 0.1, poll=0.01)
    assert 0.1 <= time.monotonic() - started < 2
