"""A volume that fills up under one real component (recovery/disk_full.py): a checkpoint write, a weight
publication, straw publishes and acceptances of the controller's queue, and straw's coordinator once its
journal append failed. Each on a real small tmpfs the test mounts (tests/tmpfs.py): the error is recognised and
said naming the flag, the directory and the operation, and what was committed before is intact and usable once
space is freed; the same straw errors on a volume with room keep their own message."""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
from straw.errors import IndeterminateCommit, QuotaExceeded, UnsafeRecovery

from tests.tmpfs import mounted_tmpfs
from vime.recovery import checkpoint as ckpt
from vime.recovery.disk_full import (
    DiskFull,
    VolumeFailed,
    VolumeLost,
    WrittenVolume,
    disk_full_cause,
    straw_failure_after_a_write,
    volume_failed_cause,
    volume_lost_cause,
)
from vime.weights import disk as weights

MiB = 1024**2


def fill(path: str, leave: int = 0) -> str:
    """Write a ballast file into ``path`` until its volume has at most ``leave`` bytes free; returns it."""
    ballast = os.path.join(path, "ballast")
    with open(ballast, "wb") as f:
        chunk = b"\0" * 64 * 1024
        try:
            while os.statvfs(path).f_bavail * os.statvfs(path).f_frsize > leave + len(chunk):
                f.write(chunk)
                f.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return ballast


def write_until_full(path: str) -> None:
    """A writer that fills its volume to the last byte and says nothing of it (a trainer's shard that fit)."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):  # unbuffered: nothing left to flush
        while True:
            f.write(b"\1" * 512)


# ----------------------------------------------------------------------------- recognising a full volume
def test_a_full_volume_is_recognised_through_wrappers_and_nothing_else_is():
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full_cause(enospc) == "No space left on device"
    assert disk_full_cause(OSError(errno.EDQUOT, "Disk quota exceeded")) == "Disk quota exceeded"
    try:
        try:
            raise enospc
        except OSError as inner:
            raise RuntimeError("publishing group t-1 to the queue failed") from inner
    except RuntimeError as outer:
        assert disk_full_cause(outer) == "No space left on device"
    assert disk_full_cause(QuotaExceeded("No space left on device (os error 28)")) == "No space left on device"
    # what is left of a remote error once only its text travelled
    assert disk_full_cause(RuntimeError("ray: ... straw.errors.QuotaExceeded: os error 28")) == "os error 28"
    for other in (OSError(errno.EACCES, "Permission denied"), ValueError("bad"), None):
        assert disk_full_cause(other) is None


def test_a_volume_whose_file_system_went_away_stops_the_run_naming_it(tmp_path):
    # What a killed FUSE client (a JuiceFS mount's process) leaves: ENOTCONN, or straw's text of it through Ray.
    lost = OSError(errno.ENOTCONN, "Transport endpoint is not connected")
    assert volume_lost_cause(lost) == "Transport endpoint is not connected"
    wrapped = RuntimeError("ray: straw.errors.StorageUnavailable: Transport endpoint is not connected (os error 107)")
    assert volume_lost_cause(wrapped) == "Transport endpoint is not connected"
    for other in (OSError(errno.ENOSPC, "No space left on device"), ValueError("bad"), None, VolumeLost("said")):
        assert volume_lost_cause(other) is None
    # The queue's volume (straw's errors are checked for a full volume first: its directory answers, not full).
    queue = WrittenVolume.queue(str(tmp_path), 64, save="/data/save")
    with pytest.raises(VolumeLost) as error:
        with queue.stop_when_full("the queue's commit of step 4"):
            raise wrapped
    message = str(error.value)
    assert message.startswith(f"the volume of --rollout-data-dir {tmp_path} is not reachable any more")
    assert "the queue's commit of step 4 failed" in message and "resume with --load /data/save" in message


def test_an_io_error_of_a_volume_stops_the_run_naming_it(tmp_path):
    # What a JuiceFS client answers when its metadata server went away during a waited-for lock: EIO, or straw's
    # text of it through a rollout worker's error and Ray.
    failed = OSError(errno.EIO, "Input/output error")
    assert volume_failed_cause(failed) == "Input/output error"
    try:
        try:
            raise RuntimeError("straw.errors.StorageUnavailable: Input/output error (os error 5)")
        except RuntimeError as inner:
            raise ValueError("publishing group g000000008 to the queue failed") from inner
    except ValueError as outer:
        wrapped = outer
    assert volume_failed_cause(wrapped) == "Input/output error"
    for other in (OSError(errno.ENOTCONN, "Transport endpoint is not connected"), ValueError("os error 50"), None):
        assert volume_failed_cause(other) is None
    for said in (VolumeFailed("said"), VolumeLost("said"), DiskFull("said")):
        assert volume_failed_cause(said) is None
    queue = WrittenVolume.queue(str(tmp_path), 64, save="/data/save")
    with pytest.raises(VolumeFailed) as error:
        with queue.stop_when_full("a call on the queue's coordinator"):
            raise wrapped
    message = str(error.value)
    assert message.startswith(f"the volume of --rollout-data-dir {tmp_path} failed a call: a call on the queue's")
    assert "(Input/output error: " in message and "resume with --load /data/save" in message
    with pytest.raises(VolumeFailed):  # already said: passes through an outer stop unchanged
        with queue.stop_when_full("the run"):
            raise error.value
    # The queue's stop surrounds the driver's whole loop: an EIO that is not straw's nor on a file in the queue's
    # directory is another volume's and keeps its own message; one on a file there is the queue's.
    elsewhere = OSError(errno.EIO, "Input/output error", "/other/volume/model.safetensors")
    with pytest.raises(OSError):
        with queue.stop_when_full("the run"):
            raise elsewhere
    with pytest.raises(VolumeFailed):
        with queue.stop_when_full("the run"):
            raise OSError(errno.EIO, "Input/output error", str(tmp_path / "control" / "journal.log"))
    with pytest.raises(VolumeFailed, match=r"^the volume of --save /data/save failed a call: the checkpoint write"):
        with WrittenVolume("--save", "/data/save", "/data/save").stop_when_full("the checkpoint write of step 4"):
            raise elsewhere  # a stop around this volume's own write: its EIO is this volume's


def test_stop_when_full_says_where_and_how_to_resume_and_lets_other_errors_pass():
    with pytest.raises(DiskFull) as error:
        with WrittenVolume("--save", "/data/save", "/data/save").stop_when_full("the checkpoint write of step 4"):
            raise OSError(errno.ENOSPC, "No space left on device")
    message = str(error.value)
    assert message.startswith("the volume of --save /data/save is full: the checkpoint write of step 4 failed")
    assert "(No space left on device)" in message and "resume with --load /data/save" in message
    assert isinstance(error.value.__cause__, OSError)
    with pytest.raises(PermissionError):
        with WrittenVolume("--save", "/data/save", None).stop_when_full("x"):
            raise PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(DiskFull, match="without --save there is no checkpoint"):
        with WrittenVolume.queue("/q", 64, save=None).stop_when_full("x"):  # straw's: the queue's, space or not
            raise QuotaExceeded("No space left on device (os error 28)")


def test_straw_errors_after_a_failed_write_mean_a_full_queue_only_on_a_volume_without_room(tmp_path):
    """On a volume with room (tmp_path's), an UnsafeRecovery, an IndeterminateCommit or a plain ENOSPC of some
    other volume is not the queue's full volume (the driver's stop around its whole loop must not blame the queue
    for them): the IndeterminateCommit is a call the queue's volume failed (straw's journal write or sync did not
    complete), the others keep their own message. What a wrapper that kept only the text says is still read."""
    text_only = RuntimeError("ray::Controller.stats() ... straw.errors.UnsafeRecovery: Coordinator unavailable; stop")
    assert straw_failure_after_a_write(text_only) == "UnsafeRecovery: Coordinator unavailable; stop"
    wrapped = RuntimeError("publishing group g1 to the queue failed: IndeterminateCommit: Journal write/sync outcome")
    assert straw_failure_after_a_write(wrapped) == "IndeterminateCommit: Journal write/sync outcome"
    assert straw_failure_after_a_write(ValueError("UnsafeRecovery happened")) is None  # no straw error named
    roomy = WrittenVolume.queue(str(tmp_path / "queue"), 64, save=None)
    for other in (text_only, wrapped, UnsafeRecovery("Coordinator unavailable"), OSError(errno.ENOSPC, "elsewhere")):
        assert roomy.full_cause(other) is None, other
    for other in (text_only, UnsafeRecovery("Coordinator unavailable"), OSError(errno.ENOSPC, "elsewhere")):
        with pytest.raises(type(other)):
            with roomy.stop_when_full("a call on the queue's coordinator"):
                raise other
    with pytest.raises(VolumeFailed, match=r"failed a call: the commit failed \(IndeterminateCommit: Journal write"):
        with roomy.stop_when_full("the commit"):
            raise wrapped
    assert roomy.full_cause(QuotaExceeded("Disk quota exceeded (os error 122)")) == "Disk quota exceeded"


def test_a_refusal_after_a_failed_journal_write_stops_the_run_naming_the_write(tmp_path):
    """The controller's QueueBroken (workers/controller.py): straw refused a call ("Coordinator unavailable") after
    a journal write of the queue failed; the stop names the write's own error, not the refusal's."""
    from vime.workers.controller import QueueBroken

    roomy = WrittenVolume.queue(str(tmp_path / "queue"), 64, save="/data/save")
    unknown = "IndeterminateCommit: Journal write/sync outcome unknown; recover and query original ID"
    broken = QueueBroken(
        f"UnsafeRecovery: Coordinator unavailable; stop owner and recover, after an earlier write "
        f"of the queue failed: {unknown}"
    )
    with pytest.raises(VolumeFailed) as stop:
        with roomy.stop_when_full("a call on the queue's coordinator"):
            raise RuntimeError("ray::Controller.take_groups() failed") from broken
    assert f"a call on the queue's coordinator failed ({unknown}: its file system could not complete" in str(stop.value)
    eio = QueueBroken(
        "CorruptData: Log header checksum, sequence or magic mismatch, after an earlier write of the "
        "queue failed: StorageUnavailable: OSError: [Errno 5] Input/output error"
    )
    with pytest.raises(VolumeFailed, match=r"failed a call: the commit failed \(Input/output error: "):
        with roomy.stop_when_full("the commit"):
            raise eio


# ----------------------------------------------------------------------------- a checkpoint write
def small_state(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.bin"), "wb") as f:
        f.write(os.urandom(64 * 1024))


@pytest.mark.parametrize("where", ["trainer state", "state file"])
def test_a_checkpoint_write_on_a_full_volume_leaves_the_last_one_loadable(tmp_path, where):
    with mounted_tmpfs(str(tmp_path / "vol"), size="2m") as volume:
        root = os.path.join(volume, "save")
        state = ckpt.CheckpointState(schema=1, step=2, weight_version=2, consumer_cursor=4, run_options={})
        ckpt.save_checkpoint(root, state, small_state)

        def too_big(folder):
            os.makedirs(folder)
            if where == "trainer state":  # the trainer's own write hits the full volume
                with open(os.path.join(folder, "model.bin"), "wb") as f:
                    f.write(os.urandom(4 * MiB))
            else:  # the trainer's shards fit to the last byte: the state file does not
                write_until_full(os.path.join(folder, "model.bin"))

        later = ckpt.CheckpointState(schema=1, step=4, weight_version=4, consumer_cursor=8, run_options={})
        with pytest.raises(DiskFull) as error:
            with WrittenVolume("--save", root, root).stop_when_full("the checkpoint write of step 4"):
                ckpt.save_checkpoint(root, later, too_big)
        assert f"--save {root} is full: the checkpoint write of step 4 failed" in str(error.value)
        # nothing half-written is visible or left behind: the staging folder and the state file's temporary
        # copy are gone (their space is free again), the latest checkpoint is the one before
        assert sorted(os.listdir(root)) == [ckpt.LOCK, "iter_0000002", ckpt.LATEST]
        assert ckpt.complete_steps(root) == [2]
        folder, loaded = ckpt.load_state(root)
        assert loaded.step == 2 and os.path.getsize(os.path.join(folder, "model.bin")) == 64 * 1024
        # once space is there again, the same step saves
        ckpt.save_checkpoint(root, later, small_state)
        assert ckpt.load_state(root)[1].step == 4


# ----------------------------------------------------------------------------- a weight publication
def test_a_weight_publication_on_a_full_volume_leaves_every_published_version_verifying(tmp_path):
    with mounted_tmpfs(str(tmp_path / "vol"), size="2m") as volume:
        root = os.path.join(volume, "weights")

        def shard(size):
            def write(folder):
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "model.safetensors"), "wb") as f:
                    f.write(os.urandom(size))

            return write

        weights.publish_full(root, 1, shard(256 * 1024))
        with pytest.raises(DiskFull, match=r"--update-weight-disk-dir .* the publication of weight version 2 failed"):
            with WrittenVolume("--update-weight-disk-dir", root, None).stop_when_full(
                "the publication of weight version 2"
            ):
                weights.publish_full(root, 2, shard(4 * MiB))
        assert weights.published_versions(root) == [1] and os.listdir(root) == ["weight_v000001"]
        assert weights.verify(weights.version_dir(root, 1)).version == 1  # its checksums still match
        weights.publish_full(root, 2, shard(256 * 1024))  # space is back (the staging folder was removed)
        assert weights.verify(weights.version_dir(root, 2)).version == 2


# ----------------------------------------------------------------------------- the queue
def controller_spec(tmp_path, data_dir: str):
    from tests.controller_spec import controller_spec as shared_spec, write_prompts
    from vime.queue.rollout_queue import StoreOptions

    return shared_spec(
        tmp_path,
        write_prompts(tmp_path, 64),
        store=StoreOptions(data_dir, "run", 0.25),
        num_epoch=1,
        groups_per_rollout=4,
        max_staleness=100,
    )


def test_straw_publishes_and_acceptances_on_a_full_queue_volume_lose_nothing_committed(tmp_path):
    from vime.queue.transport import StrawTransport
    from vime.sample import Sample, Status
    from vime.workers.controller import Controller

    with mounted_tmpfs(str(tmp_path / "vol"), size="8m") as volume:
        spec = controller_spec(tmp_path, os.path.join(volume, "queue"))
        store = spec.store
        controller = Controller(spec)
        transport = StrawTransport(store)
        ballast = fill(volume, leave=1 * MiB)
        accepted, full = [], None
        for _ in range(64):
            leased = controller.lease("w@" + transport.writer_id, 1)
            if not leased:
                break
            a = leased[0].assignment
            samples = [
                Sample(
                    group_index=a.task.group_index,
                    index=i,
                    prompt_index=a.task.prompt_index,
                    tokens=list(range(20_000)),
                    response_length=1,
                    reward=1.0,
                    status=Status.COMPLETED,
                    weight_versions=[0],
                )
                for i in range(2)
            ]
            sid = f"{a.lease.task_id}-{a.lease.attempt_id}"
            try:
                ref = transport.publish(
                    samples, task_id=a.lease.task_id, attempt_id=a.lease.attempt_id, submission_id=sid
                )
                position = controller.complete(a.lease, sid, ref, 2, 1, 0)
            except Exception as error:  # noqa: BLE001 - the volume filled: which call hit it is straw's business
                full = error
                break
            accepted.append((position, a.task.task_id))
        assert full is not None, "the volume never filled"
        assert WrittenVolume.queue(store.data_dir, store.segment_mib, None).full_cause(full) is not None, repr(full)
        assert accepted, "the volume filled before any group was accepted: the test proves nothing"
        with contextlib.suppress(Exception):
            transport.close()
        with contextlib.suppress(Exception):
            controller.shutdown()
        os.unlink(ballast)  # space is freed
        # a restarted controller recovers the journal: every group accepted before is there and reads whole
        controller = Controller(spec)
        try:
            groups, _ = controller.queue.accepted(0, 1000)
            assert [(g.position, g.task_id) for g in groups][: len(accepted)] == accepted
            reader = StrawTransport(store)
            for group in groups:
                assert [s.tokens[-1] for s in reader.read(group.ref)] == [19_999, 19_999]
            reader.close()
        finally:
            controller.shutdown()


def test_straws_coordinator_after_its_journal_filled_the_volume_is_said_full_until_space_is_back(tmp_path):
    """The failure the e2e run met on a clean clone: an acceptance whose journal append finds the volume full
    raises IndeterminateCommit, and from then on straw's coordinator answers every call (the driver's stats())
    with UnsafeRecovery "Coordinator unavailable". Both are the queue's full volume while it has no room; once
    space is back the coordinator still refuses (it must be recovered), and the stop then says a call failed,
    naming the append (the controller's QueueBroken). A restarted controller recovers the journal and goes on."""
    from vime.queue.transport import StrawTransport
    from vime.sample import Sample, Status
    from vime.workers.controller import Controller, QueueBroken

    with mounted_tmpfs(str(tmp_path / "vol"), size="8m") as volume:
        spec = controller_spec(tmp_path, os.path.join(volume, "queue"))
        queue = WrittenVolume.queue(spec.store.data_dir, spec.store.segment_mib, "/ckpt")
        controller = Controller(spec)
        transport = StrawTransport(spec.store)
        a = controller.lease("w@" + transport.writer_id, 1)[0].assignment
        samples = [
            Sample(
                group_index=a.task.group_index,
                index=i,
                prompt_index=a.task.prompt_index,
                tokens=[1, 2],
                response_length=1,
                reward=1.0,
                status=Status.COMPLETED,
                weight_versions=[0],
            )
            for i in range(2)
        ]
        ref = transport.publish(samples, task_id=a.lease.task_id, attempt_id=a.lease.attempt_id, submission_id="s0")
        ballast = fill(volume)
        write_until_full(ballast + "-rest")  # not a byte left: the acceptance's journal append fails
        with pytest.raises(IndeterminateCommit) as append:
            controller.complete(a.lease, "s0", ref, 2, 1, 0)
        with pytest.raises(QueueBroken, match="Coordinator unavailable.*IndeterminateCommit") as refused:
            controller.stats()  # straw's refusal, naming the append that failed (workers/controller.py)
        for error, said in (
            (append.value, "IndeterminateCommit: Journal write/sync outcome unknown"),
            (refused.value, "UnsafeRecovery: Coordinator unavailable"),
        ):
            full = queue.full_error("a call on the queue's coordinator", error)
            assert isinstance(full, DiskFull), error
            assert str(full).startswith(
                f"the volume of --rollout-data-dir {spec.store.data_dir} is full: a call on the queue's coordinator "
                f"failed ({said}"
            ), str(full)
            assert "B free there)" in str(full) and str(full).endswith(
                "resume with --load /ckpt (nothing accepted is lost, nothing is trained twice)"
            )
        os.unlink(ballast)
        os.unlink(ballast + "-rest")  # space is back; the coordinator still refuses until it is recovered
        with pytest.raises(VolumeFailed, match=r"failed \(IndeterminateCommit: Journal write/sync") as later:
            with queue.stop_when_full("a call on the queue's coordinator"):
                controller.stats()  # no longer full: a call the volume failed, naming the append's own error
        assert queue.full_cause(later.value.__cause__) is None
        with contextlib.suppress(Exception):
            transport.close()
        with contextlib.suppress(Exception):
            controller.shutdown()
        controller = Controller(spec)  # what --load does: a new owner recovers the journal
        try:
            assert controller.stats().accepted in (0, 1)  # the append's outcome was unknown: either is whole
        finally:
            controller.shutdown()


def test_a_writer_created_on_a_full_queue_volume_is_skipped_by_the_reaping_of_dead_producers(tmp_path):
    """A rollout worker that opens its straw writer on a full volume leaves an empty gate file and nothing else:
    it published nothing, and the reaping at the resumed run's start must not stop on it (seen in the e2e run)."""
    from vime.queue.gc import never_started
    from vime.workers.controller import Controller

    with mounted_tmpfs(str(tmp_path / "vol"), size="8m") as volume:
        spec = controller_spec(tmp_path, os.path.join(volume, "queue"))
        controller = Controller(spec)
        try:
            ballast = fill(volume)
            write_until_full(ballast + "-rest")
            store = spec.store.open()
            with pytest.raises(QuotaExceeded):
                store.publish([], submission_id="on-a-full-volume")
            dead = store.writer_id
            os.unlink(ballast)
            os.unlink(ballast + "-rest")
            assert never_started(spec.store.data_dir, dead)
            report = controller.reap_writers([])  # what a resumed run does first
        finally:
            controller.shutdown()
        assert report["writers_never_started"] == 1 and report["writers_retired"] == 0


# ----------------------------------------------------------------------------- a debug archive
def test_a_debug_archive_on_a_full_volume_stops_clearly_and_leaves_no_partial_archive(tmp_path):
    """--save-debug-rollout-data's archive of a step does not fit: the driver's stop names the flag and the
    step, the archives written before stay readable, no temporary file is left, and once space is back the
    same step's archive is written (the resumed run retrains that step)."""
    from tests.unit.test_debug_replay import make_archive
    from vime.recovery import debug_archive as da

    with mounted_tmpfs(str(tmp_path / "vol"), size="1m") as volume:
        template = os.path.join(volume, "debug", "{rollout_id}.vdr")
        volumes = WrittenVolume("--save-debug-rollout-data", template, None)
        first = da.archive_path(template, 1)
        assert da.write_archive(first, make_archive(rollout_id=1)) == "written"
        ballast, last_bytes = fill(volume), os.path.join(volume, "last_bytes")
        write_until_full(last_bytes)  # an archive of a few KiB would fit in what fill() leaves
        second = da.archive_path(template, 2)
        with pytest.raises(DiskFull) as error:
            with volumes.stop_when_full("the debug archive of rollout 2"):
                da.write_archive(second, make_archive(rollout_id=2))
        message = str(error.value)
        assert message.startswith(f"the volume of --save-debug-rollout-data {template} is full: "), message
        assert "the debug archive of rollout 2 failed" in message
        assert sorted(os.listdir(os.path.dirname(first))) == ["1.vdr"]  # no partial archive, no temporary file
        assert da.read_archive(first).rollout_id == 1
        os.unlink(ballast)
        os.unlink(last_bytes)
        assert da.write_archive(second, make_archive(rollout_id=2)) == "written"
        assert da.read_archive(second).rollout_id == 2
