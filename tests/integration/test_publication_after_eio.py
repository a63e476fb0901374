"""A rollout worker's publication that fails while straw makes it durable (an fsync answering EIO, as a JuiceFS
client does when its metadata server went away for a while) must not stop that worker's later publications.

straw then refuses every other publication of the handle with ``IndeterminateCommit`` until the failed one is
published again under its submission id; a worker that gave the failed group back to the queue and went on
published nothing ever again (seen in tests/faults/test_juicefs_storage_faults.py: the run hung, the worker
returning the same groups forever). queue/transport.py resolves it before the next publication.

Real straw and the real controller; the EIO comes through straw's own hook at the phases of its writes, the
only way to make one call of a real file system fail here (a JuiceFS outage does it too, but not on demand).
"""

from __future__ import annotations

import errno

import pytest
from straw.errors import StorageUnavailable

from tests.controller_spec import completed_group, controller_spec, write_prompts
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import StrawTransport
from vime.workers.controller import Controller

pytestmark = pytest.mark.integration

RESPONSE = 3


class FailingSyncs:
    """straw's write hook: the next ``count`` file syncs fail with EIO, as a volume that cannot make data durable."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str) -> None:
        if phase == "before_file_sync" and self.count > 0:
            self.count -= 1
            raise OSError(errno.EIO, "Input/output error")


@pytest.fixture
def run(tmp_path):
    prompts = write_prompts(tmp_path, 8)
    spec = controller_spec(tmp_path, prompts)
    controller = Controller(spec)
    syncs = FailingSyncs()
    transport = StrawTransport(StoreOptions(spec.store.data_dir, spec.store.run_id, 1.0), syncs)
    yield controller, transport, syncs, f"worker@{transport.writer_id}"
    transport.close()
    controller.shutdown()


def publish(transport: StrawTransport, item):
    lease, task = item.assignment.lease, item.assignment.task
    samples = completed_group(task, RESPONSE)
    sid = f"group-{lease.task_id}-{lease.attempt_id}"
    return sid, transport.publish(samples, task_id=lease.task_id, attempt_id=lease.attempt_id, submission_id=sid)


def give_back(controller: Controller, item) -> None:
    """What the rollout worker does with a group whose publication failed: back to the queue, no attempt spent."""
    controller.return_partial(item.assignment.lease, item.assignment.task, None)


def test_the_groups_published_after_a_failed_sync_are_accepted_and_read_back(run, caplog):
    controller, transport, syncs, worker = run
    (first,) = controller.lease(worker, 1)
    syncs.count = 1
    with pytest.raises(StorageUnavailable, match="Input/output error"):
        publish(transport, first)
    give_back(controller, first)
    failed_id = f"group-{first.assignment.lease.task_id}-{first.assignment.lease.attempt_id}"

    accepted = []
    for _ in range(4):  # three more groups, then the failed group's prompt again (a new attempt)
        (item,) = controller.lease(worker, 1)
        sid, ref = publish(transport, item)
        position = controller.complete(item.assignment.lease, sid, ref, 2, 2 * RESPONSE, 0)
        assert position is not None, item.assignment.task.task_id
        accepted.append(item.assignment.task.task_id)
    assert first.assignment.task.task_id in accepted
    assert controller.stats().accepted == 4
    # The failed publication was published again under its own submission id before the next one (and released),
    # never adopted: the queue's groups are the four accepted ones, each read back whole.
    assert f"publishing {failed_id} again" in caplog.text and transport.failed is None
    taken = controller.take_groups(0, 4, 0, 0)
    assert sorted(group.task_id for group in taken.groups) == sorted(accepted)
    for group in taken.groups:
        assert len(transport.read(group.ref)) == 2


def test_while_the_volume_still_fails_each_publication_fails_and_the_first_after_it_goes_through(run):
    controller, transport, syncs, worker = run
    syncs.count = 3  # the publication, then the two tries to resolve it before the next ones
    for _ in range(3):
        (item,) = controller.lease(worker, 1)
        with pytest.raises(StorageUnavailable):
            publish(transport, item)
        give_back(controller, item)
    (item,) = controller.lease(worker, 1)
    sid, ref = publish(transport, item)
    assert controller.complete(item.assignment.lease, sid, ref, 2, 2 * RESPONSE, 0) is not None
    assert transport.failed is None
