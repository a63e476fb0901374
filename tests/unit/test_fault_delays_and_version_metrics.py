"""The slow-component injection used by the staleness tests, the holds that keep a test's run open (a driver's
step, a rollout worker in the middle of writing a pack), the injected I/O errors, and the tokens-per-version
metric."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from vime.recovery.faults import CONTROLLER_STRAW, StrawWriteFaults, fault_point, held
from vime.sample import Sample
from vime.workers.trainer_worker import tokens_per_version


def test_delay_sleeps_at_every_hit_of_its_point_only(monkeypatch):
    monkeypatch.setenv("VIME_FAULT_DELAYS", "trainer.mid_step=0.2, other.point=5")
    monkeypatch.delenv("VIME_FAULTS", raising=False)
    started = time.monotonic()
    fault_point("trainer.mid_step")
    fault_point("trainer.mid_step")
    slept = time.monotonic() - started
    assert 0.4 <= slept < 2.0
    started = time.monotonic()
    fault_point("rollout.after_publish")  # not delayed
    assert time.monotonic() - started < 0.1


def test_a_hold_lasts_from_its_position_until_the_release_file_exists_and_can_be_armed_again(monkeypatch, tmp_path):
    release = tmp_path / "release"
    monkeypatch.setenv("VIME_FAULT_HOLDS", "driver.before_step=3")
    monkeypatch.setenv("VIME_FAULT_RELEASE", str(release))
    assert [held("driver.before_step", step) for step in (1, 2, 3, 4)] == [False, False, True, True]
    assert not held("other.point", 5)
    release.touch()
    assert not held("driver.before_step", 4)
    release.unlink()  # a test holds the run again for a later event
    assert held("driver.before_step", 5)
    monkeypatch.delenv("VIME_FAULT_HOLDS")
    assert not held("driver.before_step", 5)


def test_a_straw_write_is_held_mid_pack_at_the_publication_a_test_names(monkeypatch, tmp_path):
    from straw import Record

    from vime.queue.rollout_queue import StoreOptions

    monkeypatch.delenv("VIME_FAULTS", raising=False)
    monkeypatch.delenv("VIME_FAULT_DELAYS", raising=False)
    monkeypatch.delenv("VIME_FAULT_HOLDS", raising=False)
    assert StrawWriteFaults.if_enabled() is None  # no straw point set: straw gets no hook at all
    release, state = tmp_path / "release", tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("VIME_FAULT_HOLDS", "driver.before_step=9,straw.after_payload_chunk=2")
    monkeypatch.setenv("VIME_FAULT_RELEASE", str(release))
    monkeypatch.setenv("VIME_FAULT_STATE", str(state))
    store = StoreOptions(str(tmp_path / "queue")).open(StrawWriteFaults.if_enabled())
    first = store.publish([Record("m", b"one" * 1000)], submission_id="one")  # publication 1: not held
    marker = state / "straw.after_payload_chunk.held"
    assert not marker.exists()
    refs = []
    second = [Record("m", b"two" * 1000)]
    writer = threading.Thread(target=lambda: refs.append(store.publish(second, submission_id="two")))
    writer.start()
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the second publication was never held"
        time.sleep(0.02)
    assert marker.read_text() == str(os.getpid())
    time.sleep(0.3)
    assert writer.is_alive() and not refs  # held mid-write: its pack has no footer, no reference exists
    release.touch()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert [next(store.read(ref)).payload for ref in (first, refs[0])] == [b"one" * 1000, b"two" * 1000]
    store.close()


def test_an_error_point_raises_eio_at_its_nth_hit_once_per_run(monkeypatch, tmp_path):
    monkeypatch.delenv("VIME_FAULTS", raising=False)
    monkeypatch.delenv("VIME_FAULT_DELAYS", raising=False)
    monkeypatch.setenv("VIME_FAULT_ERRORS", "straw.before_file_sync@2")
    monkeypatch.setenv("VIME_FAULT_STATE", str(tmp_path))
    assert StrawWriteFaults.if_enabled() is not None  # a straw point: straw gets the hook
    fault_point("straw.before_file_sync")  # the first hit passes
    fault_point("rollout.after_publish")  # another point: nothing
    with pytest.raises(OSError) as raised:
        fault_point("straw.before_file_sync")
    assert raised.value.errno == errno.EIO and "VIME_FAULT_ERRORS" in str(raised.value)
    assert (tmp_path / "straw.before_file_sync.failed").read_text() == str(os.getpid())
    for _ in range(3):
        fault_point("straw.before_file_sync")  # fired once: later hits, and a restarted process, pass
    # The controller's handle has its points under their own prefix: a rollout worker's gets no hook for them.
    monkeypatch.setenv("VIME_FAULT_ERRORS", f"{CONTROLLER_STRAW}.before_file_sync@2")
    assert StrawWriteFaults.if_enabled() is None
    hook = StrawWriteFaults.if_enabled(CONTROLLER_STRAW)
    assert hook is not None
    hook("before_file_sync")
    with pytest.raises(OSError, match=f"VIME_FAULT_ERRORS at {CONTROLLER_STRAW}.before_file_sync"):
        hook("before_file_sync")


def test_tokens_per_version_counts_each_response_token_by_its_version():
    a = Sample(tokens=[1, 2, 3, 4, 5], response_length=3, weight_versions=[2, 2, 3])
    b = Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[3, 4])
    empty = Sample(tokens=[1], response_length=0, weight_versions=[])
    assert tokens_per_version([a, b, empty]) == {"2": 2, "3": 2, "4": 1}
    assert list(tokens_per_version([b, a])) == ["2", "3", "4"]  # ordered by version
