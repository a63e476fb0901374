"""workers/controller.py's @on_the_queue: the first failed write of the queue is remembered and named in straw's
later refusals, and told to the controller once (which may end its process there: recovery/volume_failure.py).
The decorator's own rules, on a small class whose methods raise straw's real errors as its queue would (a real
queue's journal failing: tests/unit/test_disk_full.py and tests/faults/test_fault_injection.py)."""

from __future__ import annotations

import pytest
from straw.errors import CorruptData, IndeterminateCommit, StorageUnavailable, UnsafeRecovery

from vime.workers.controller import QueueBroken, on_the_queue


class Calls:
    def __init__(self) -> None:
        self.fence = None  # no queue fence to check (queue/fence.py's tests check the controller's)
        self.queue_failure = None
        self.refusal: OSError | None = None  # an incarnation that refused the queue (recovery/volume_failure.py)
        self.next_error: Exception | None = None
        self.told: list[Exception] = []  # the failed writes first_failed_write was told of

    def first_failed_write(self, error: Exception) -> None:  # the controller's may end its process here
        self.told.append(error)

    @on_the_queue
    def call(self) -> str:
        if self.next_error is not None:
            raise self.next_error
        return "ok"

    @on_the_queue
    def outer(self) -> str:
        return self.call()  # a controller call made by another (take_groups calls sync)


def test_the_first_failed_write_passes_as_it_is_and_the_refusals_after_it_name_it():
    calls = Calls()
    calls.next_error = UnsafeRecovery("Coordinator unavailable; stop owner and recover")
    with pytest.raises(UnsafeRecovery):  # no failed write before it: straw's own error (a second owner, say)
        calls.call()
    assert calls.queue_failure is None
    append = IndeterminateCommit("Journal write/sync outcome unknown; recover and query original ID")
    calls.next_error = append
    with pytest.raises(IndeterminateCommit) as first:
        calls.outer()  # through two decorated calls: still the write's own error, not "after an earlier" one
    assert first.value is append and calls.queue_failure is append
    assert calls.told == [append]  # once, though two decorated calls saw it
    for refusal in (UnsafeRecovery("Coordinator unavailable"), CorruptData("Log header checksum mismatch")):
        calls.next_error = refusal
        with pytest.raises(QueueBroken) as broken:
            calls.call()
        assert str(broken.value) == (
            f"{type(refusal).__name__}: {refusal}, after an earlier write of the queue failed: "
            "IndeterminateCommit: Journal write/sync outcome unknown; recover and query original ID"
        )
        assert broken.value.__cause__ is refusal
    calls.next_error = StorageUnavailable("OSError: [Errno 5] Input/output error")
    with pytest.raises(StorageUnavailable):  # another failed write: itself, the first one still remembered
        calls.call()
    assert calls.queue_failure is append and calls.told == [append]
    calls.next_error = None
    assert calls.call() == "ok"


def test_an_incarnation_that_refused_the_queue_answers_every_call_with_the_volume_s_error():
    calls = Calls()
    calls.refusal = OSError(5, "Input/output error: the queue's writes failed again after 3 restarts")
    calls.next_error = AssertionError("the method ran")  # it must not: the queue was never taken
    for call in (calls.call, calls.outer):
        with pytest.raises(OSError) as refused:
            call()
        assert refused.value is calls.refusal
    assert calls.told == [] and calls.queue_failure is None  # not a failed write of this incarnation's
