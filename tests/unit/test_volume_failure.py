"""recovery/volume_failure.py: which failed writes of the queue a new controller rides out, the wait for the volume
to take a write again, and the controller ending itself on such a write (the whole run: a controller's journal sync
failing mid-run, tests/faults/test_fault_injection.py)."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from straw.errors import IndeterminateCommit, StorageUnavailable, UnsafeRecovery

from tests.controller_spec import controller_spec, write_prompts
from vime.recovery.disk_full import VolumeFailed, WrittenVolume
from vime.recovery.volume_failure import (
    MAX_VOLUME_RESTARTS,
    PROBE_NAME,
    RESTARTS_NAME,
    forget_volume_restarts,
    ridden_out_cause,
    wait_until_writable,
)
from vime.workers import controller as controller_module
from vime.workers.controller import Controller

# Ray's text of a controller whose new incarnation found its volume still failing (its creation task raised the
# probe's error; Ray keeps only the text), as Ray 2.x writes it.
RAY_CREATION_FAILURE = (
    "The actor died because of an error raised in its creation task, ray::vime-controller:Controller.__init__() "
    '(pid=503, ip=127.0.0.1, actor_id=4c748e4d7fe1f1ae95037ce201000000)\n  File "recovery/volume_failure.py", '
    "line 52, in probe\nOSError: [Errno 5] Input/output error: '{probe}'"
)


def test_a_call_the_volume_failed_is_ridden_out_and_a_full_or_lost_volume_or_another_error_is_not(tmp_path):
    queue = WrittenVolume.queue(str(tmp_path), 1, save=None)  # tmp_path has room: straw's unknown outcome is a failure
    unknown = IndeterminateCommit("Journal write/sync outcome unknown; recover and query original ID")
    assert ridden_out_cause(queue, unknown) == f"IndeterminateCommit: {unknown}"
    eio = StorageUnavailable("write inode:17 error: Input/output error (os error 5)")
    assert ridden_out_cause(queue, eio) == f"StorageUnavailable: {eio}"
    assert ridden_out_cause(queue, OSError(errno.EIO, "Input/output error", str(tmp_path / "controller.lock")))
    for stop in (
        OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "control" / "journal.log")),  # full
        StorageUnavailable("Transport endpoint is not connected (os error 107)"),  # the mount's client is gone
        UnsafeRecovery("Coordinator unavailable; stop owner and recover"),  # a refusal, not the failed write
        OSError(errno.EIO, "Input/output error", "/another/volume/model.safetensors"),  # not the queue's volume
        ValueError("os error 5"),
    ):
        assert ridden_out_cause(queue, stop) is None, stop


def test_the_wait_returns_once_the_volume_takes_a_write_and_leaves_nothing_behind(tmp_path):
    said: list[str] = []
    wait_until_writable(str(tmp_path), wait_seconds=5, say=said.append)
    assert said == [] and os.listdir(tmp_path) == []
    wait_until_writable(str(tmp_path / "not-yet"), wait_seconds=0, say=said.append)  # a new queue: nothing to wait for
    assert said == []
    # A volume whose writes fail for a while: here the probe's own file cannot be created (a directory holds its
    # name), until something frees it, as a metadata server that comes back.
    (tmp_path / PROBE_NAME).mkdir()
    threading.Timer(0.6, (tmp_path / PROBE_NAME).rmdir).start()
    wait_until_writable(str(tmp_path), wait_seconds=30, retry_seconds=0.1, say=said.append)
    assert len(said) >= 3 and all("does not take a write" in line for line in said[:-1]), said
    assert said[-1].startswith(f"the queue's volume {tmp_path} takes writes again (after ")
    assert os.listdir(tmp_path) == []


def test_a_volume_still_failing_after_the_wait_stops_the_run_naming_the_flag(tmp_path):
    (tmp_path / PROBE_NAME).mkdir()
    said: list[str] = []
    with pytest.raises(OSError) as failing:
        wait_until_writable(str(tmp_path), wait_seconds=0.3, retry_seconds=0.1, say=said.append)
    assert said[-1].startswith(f"the queue's volume {tmp_path} still fails after 0s: ")
    assert failing.value.filename == str(tmp_path / PROBE_NAME)
    # The driver sees the new incarnation's error as Ray's text only; the queue's stop names the volume and flag.
    died = RuntimeError(RAY_CREATION_FAILURE.format(probe=tmp_path / PROBE_NAME))
    queue = WrittenVolume.queue(str(tmp_path), 1, save="/data/save")
    with pytest.raises(VolumeFailed, match=f"^the volume of --rollout-data-dir {tmp_path} failed a call: the run"):
        with queue.stop_when_full("the run"):
            raise died
    elsewhere = RuntimeError(RAY_CREATION_FAILURE.format(probe="/another/volume/x"))
    with pytest.raises(RuntimeError):  # another volume's EIO keeps its own message
        with queue.stop_when_full("the run"):
            raise elsewhere


def test_a_volume_whose_client_is_gone_is_not_waited_for(tmp_path, monkeypatch):
    """A mount whose client died answers ENOTCONN until it is mounted again: the wait gives up at once, and the new
    incarnation's refusal is the lost volume's. Stand-in: the probe's error (a plain directory cannot lose its client;
    the real mount's is tests/faults/test_juicefs_storage_faults.py, where a 300-s wait outlived its bound)."""
    import time

    from vime.recovery import volume_failure

    lost = OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(tmp_path / PROBE_NAME))
    tries = []

    def probe(data_dir):
        tries.append(data_dir)
        raise lost

    monkeypatch.setattr(volume_failure, "probe", probe)
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        wait_until_writable(str(tmp_path), wait_seconds=30, retry_seconds=0.1, say=said.append)
    assert raised.value is lost and len(tries) == 1 and time.monotonic() - started < 5
    assert said == [f"the queue's volume {tmp_path} is not reachable any more: {lost}"]


class Ended(BaseException):
    """Stands in for the end of the controller's process (os._exit would end pytest's); the real one: the e2e."""


def test_the_controller_ends_itself_on_a_failed_write_only_when_ray_restarts_it(tmp_path, monkeypatch):
    ended: list[str] = []

    def end() -> None:
        ended.append("ended")
        raise Ended

    monkeypatch.setattr(controller_module, "end_this_process", end)
    prompts = write_prompts(tmp_path, 8)
    unknown = IndeterminateCommit("Journal write/sync outcome unknown; recover and query original ID")
    plain = Controller(controller_spec(tmp_path / "plain", prompts))
    plain.first_failed_write(unknown)  # made in-process (restart_on_volume_failure False): the caller gets it
    plain.shutdown()
    assert ended == []
    restartable = Controller(controller_spec(tmp_path / "actor", prompts, restart_on_volume_failure=True))
    restartable.first_failed_write(OSError(errno.ENOSPC, "No space left on device"))  # full: the run stops instead
    assert ended == []
    with pytest.raises(Ended):
        restartable.first_failed_write(unknown)
    assert ended == ["ended"]
    restartable.shutdown()
    # Its next incarnation finds the volume still failing after its wait: it answers every call with the volume's
    # error (the run stops, naming the flag) instead of ending itself for another restart, and takes nothing of the
    # queue (a constructor that raised would have Ray print the error with its traceback for every call in flight).
    (tmp_path / "actor" / "queue" / PROBE_NAME).mkdir()
    spec = controller_spec(tmp_path / "actor", prompts, restart_on_volume_failure=True, volume_wait_seconds=0.2)
    refusing = Controller(spec)
    for call in (
        refusing.ready,
        refusing.stats,
        lambda: refusing.lease("worker", 2),
        lambda: refusing.commit(1, 0, [0], []),
    ):
        with pytest.raises(OSError) as failing:
            call()
        assert failing.value.filename == str(tmp_path / "actor" / "queue" / PROBE_NAME) and ended == ["ended"]
    refusing.shutdown()
    (tmp_path / "actor" / "queue" / PROBE_NAME).rmdir()  # the volume answers again: the queue is recovered
    again = Controller(spec)
    assert again.ready()["incarnation"] != restartable.incarnation
    again.shutdown()


def test_incarnations_that_keep_failing_the_same_write_stop_the_run_naming_the_flag(tmp_path, monkeypatch):
    """A volume that takes the probe's write but keeps failing the queue's (CI once: a JuiceFS lock waited for when
    Redis died failed with EIO in every incarnation, until Ray's ten restarts were spent and the run stopped saying
    only that the controller died): after MAX_VOLUME_RESTARTS incarnations in a row ended so, the next one answers
    every call with the volume's error, which the driver reports naming --rollout-data-dir; a committed step starts
    the count over."""

    def end() -> None:
        raise Ended

    monkeypatch.setattr(controller_module, "end_this_process", end)
    prompts = write_prompts(tmp_path, 8)
    spec = controller_spec(tmp_path / "actor", prompts, restart_on_volume_failure=True, volume_wait_seconds=0.2)
    failed = StorageUnavailable("write inode:17 error: Input/output error (os error 5)")
    for _ in range(MAX_VOLUME_RESTARTS):
        incarnation = Controller(spec)
        with pytest.raises(Ended):
            incarnation.first_failed_write(failed)
        incarnation.shutdown()
    refusing = Controller(spec)
    with pytest.raises(OSError, match=f"failed again after {MAX_VOLUME_RESTARTS} restarts") as refused:
        refusing.sync(0, 0, 0)
    refusing.shutdown()
    queue = WrittenVolume.queue(str(tmp_path / "actor" / "queue"), 1, save="/data/save")
    said = RuntimeError(f"The actor died because of an error raised in its creation task ...\nOSError: {refused.value}")
    with pytest.raises(VolumeFailed, match="^the volume of --rollout-data-dir .* failed a call: the run"):
        with queue.stop_when_full("the run"):
            raise said
    # A committed step (the queue's writes go through again) starts the count over.
    forget_volume_restarts(str(tmp_path / "actor" / "queue"))
    again = Controller(spec)
    again.commit(1, 0, [0], [])
    again.shutdown()
    assert not (tmp_path / "actor" / "queue" / RESTARTS_NAME).exists()
