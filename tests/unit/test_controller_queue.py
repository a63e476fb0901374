"""The controller over the real straw queue (and the in-memory twin): leases, exactly-once
acceptance, admission, scheduling order, fencing and restart."""

import pytest
from straw.errors import IdempotencyConflict as StrawConflict

from tests.controller_spec import controller_spec, write_prompts
from vime.queue.fence import QueueBusy
from vime.queue.memory_queue import IdempotencyConflict as MemoryConflict
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import StrawTransport
from vime.sample import Sample, Status
from vime.workers.controller import Controller


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path, 10)


def make_spec(tmp_path, prompts, transport="straw", **overrides):
    return controller_spec(tmp_path, prompts, transport=transport, **overrides)


class InlineBox:
    """Object-store transport without Ray: the controller only stores and returns the reference."""

    def __init__(self, samples):
        self.samples = samples


def publish(tmp_path, transport, leased, reward=1.0):
    a = leased.assignment
    samples = [
        Sample(
            group_index=a.task.group_index,
            index=i,
            prompt_index=a.task.prompt_index,
            tokens=[1, 2, 3],
            response_length=1,
            reward=reward,
            status=Status.COMPLETED,
            weight_versions=[0],
        )
        for i in range(2)
    ]
    sid = f"{a.lease.task_id}-{a.lease.attempt_id}"
    if transport == "straw":
        ref = StrawTransport(StoreOptions(str(tmp_path / "queue"), "run")).publish(
            samples, task_id=a.lease.task_id, attempt_id=a.lease.attempt_id, submission_id=sid
        )
    else:
        ref = InlineBox(samples)
    return sid, ref


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_exactly_once_acceptance(tmp_path, prompts, transport):
    controller = Controller(make_spec(tmp_path, prompts, transport))
    first = controller.lease("w", 1)[0]
    sid, ref = publish(tmp_path, transport, first)
    position = controller.complete(first.assignment.lease, sid, ref, 2, 2, 0)
    assert controller.complete(first.assignment.lease, sid, ref, 2, 2, 0) == position  # retried: same receipt
    assert controller.stats().accepted == 1
    _, other = publish(tmp_path, transport, first, reward=0.0)
    with pytest.raises((StrawConflict, MemoryConflict)):
        controller.complete(first.assignment.lease, sid, other, 2, 2, 0)  # same attempt, different content
    controller.shutdown()


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_admission_bounds_outstanding_groups(tmp_path, prompts, transport):
    controller = Controller(make_spec(tmp_path, prompts, transport, groups_per_rollout=2, max_staleness=1))
    leased = controller.lease("w", 100)
    assert len(leased) == 4  # (version 0 + staleness 1 + 1) x 2 groups
    assert controller.lease("w", 100) == []
    for item in leased[:2]:
        controller.complete(item.assignment.lease, *publish(tmp_path, transport, item), 2, 2, 0)
    assert controller.lease("w", 100) == []  # accepted-but-untrained groups still count
    assert controller.take_groups(0, 3, 0, 0).groups == []  # only two accepted so far
    assert len(controller.take_groups(0, 2, 0, 0).groups) == 2
    assert controller.lease("w", 100) == []  # the trainer has not moved to version 1 yet
    controller.sync(1, 2, 2)
    assert len(controller.lease("w", 100)) == 2
    controller.shutdown()


def test_synchronous_admission_is_one_rollout_per_version(tmp_path, prompts):
    controller = Controller(make_spec(tmp_path, prompts, max_staleness=0, groups_per_rollout=3))
    assert len(controller.lease("w", 100)) == 3
    assert controller.lease("w", 100) == []
    controller.shutdown()


def test_continuations_come_first_then_oldest_version(tmp_path, prompts):
    controller = Controller(make_spec(tmp_path, prompts, groups_per_rollout=5, max_staleness=3))
    leased = controller.lease("w", 3)
    a, b, c = leased
    transport = StrawTransport(StoreOptions(str(tmp_path / "queue"), "run"))
    for item, version in ((a, 2), (b, 1)):
        lease = item.assignment.lease
        partial = transport.publish(
            [Sample(index=0, tokens=[1, 2], response_length=1, weight_versions=[version])],
            task_id=lease.task_id,
            attempt_id=lease.attempt_id,
            submission_id=f"partial-{lease.attempt_id}",
        )
        assert controller.return_partial(lease, item.assignment.task.as_continuation(version), partial)
    order = [x.assignment.task.task_id for x in controller.lease("w", 3)]
    assert order[:2] == [b.assignment.task.task_id, a.assignment.task.task_id]
    assert order[2] not in {a.assignment.task.task_id, b.assignment.task.task_id, c.assignment.task.task_id}
    controller.shutdown()


def test_fence_refuses_a_second_live_controller(tmp_path, prompts):
    controller = Controller(make_spec(tmp_path, prompts))
    with pytest.raises(QueueBusy, match="another live controller"):
        Controller(make_spec(tmp_path, prompts))
    controller.shutdown()
    Controller(make_spec(tmp_path, prompts)).shutdown()  # free again once the first released it


def test_restart_fences_old_leases_and_keeps_the_dataset_cursor(tmp_path, prompts):
    controller = Controller(make_spec(tmp_path, prompts, groups_per_rollout=2, max_staleness=0))
    leased = controller.lease("w", 2)
    submitted_before = {t.prompt_index for t in controller.queue.pending()} | {
        x.assignment.task.prompt_index for x in leased
    }
    controller.shutdown()
    restarted = Controller(make_spec(tmp_path, prompts, groups_per_rollout=2, max_staleness=0))
    sid, ref = publish(tmp_path, "straw", leased[0])
    assert restarted.complete(leased[0].assignment.lease, sid, ref, 2, 2, 0) is None  # the old lease is fenced
    again = restarted.lease("w2", 2)
    assert {x.assignment.task.task_id for x in again} == {x.assignment.task.task_id for x in leased}
    restarted._refill()
    pending = [t.prompt_index for t in restarted.queue.pending()]
    assert len(pending) == len(set(pending))
    assert not (set(pending) & {x.assignment.task.prompt_index for x in again})
    assert submitted_before <= set(pending) | {x.assignment.task.prompt_index for x in again}
    restarted.shutdown()


def test_stale_groups_are_skipped_and_their_prompts_regenerated_once(tmp_path, prompts):
    controller = Controller(make_spec(tmp_path, prompts, groups_per_rollout=2, max_staleness=1))
    leased = controller.lease("w", 4)
    for item, min_version in zip(leased, (0, 2, 0, 2)):
        controller.complete(item.assignment.lease, *publish(tmp_path, "straw", item), 2, 2, min_version)
    taken = controller.take_groups(0, 2, 2, 0)  # policy 2: groups from version 0 are 2 versions old
    assert [g.position for g in taken.groups] == [1, 3] and taken.skipped == [0, 2] and taken.next_cursor == 4
    again = controller.take_groups(0, 2, 2, 0)  # re-asking is idempotent: no duplicate resubmission
    assert again.skipped == [0, 2]
    regenerated = [t for t in controller.queue.pending() if t.task_id.startswith("r")]
    assert sorted(t.prompt_index for t in regenerated) == sorted(leased[i].assignment.task.prompt_index for i in (0, 2))
    assert controller.stats().regenerated == 2
    controller.shutdown()


def test_a_writer_killed_while_it_was_created_is_skipped_and_others_are_reaped(tmp_path, prompts):
    """A SIGKILL of the whole job can land while a producer's straw writer is being created, before its journal
    holds its first transaction (seen in the random-kill fault test, twice: no journal file yet, and an empty
    one): straw then refuses to recover it (StorageUnavailable, UnsafeRecovery). It published nothing, so
    reaping skips it; a dead writer that did publish is still retired, and any other unrecoverable writer still
    stops the reaping."""
    import os

    from straw.errors import CorruptData, UnsafeRecovery

    controller = Controller(make_spec(tmp_path, prompts))
    data_dir = str(tmp_path / "queue")
    [leased] = controller.lease("w", 1)
    publish(tmp_path, "straw", leased)  # a producer that published, then died
    unstarted = StrawTransport(StoreOptions(data_dir, "run"))
    unstarted.publish([], task_id="x", attempt_id="y", submission_id="z")
    unstarted_id = unstarted.store.writer_id
    journal = os.path.join(
        data_dir, "control", "writers", unstarted_id[:2], unstarted_id, "operations", "control", "journal.log"
    )
    os.remove(journal)  # what a kill can leave: the control folder made, the journal not created yet
    report = controller.reap_writers([])
    assert report["writers_never_started"] == 1 and report["writers_retired"] >= 1
    open(journal, "w").close()  # or the journal created, nothing in it
    report = controller.reap_writers([])
    assert report["writers_never_started"] == 1
    # Or earlier still: straw had made the writer's folder and nothing in it (no gate yet).
    earliest = os.path.join(data_dir, "control", "writers", "00", "00" + "e" * 30)
    os.makedirs(earliest)
    report = controller.reap_writers([])
    assert report["writers_never_started"] == 2
    os.rmdir(earliest)
    with open(journal, "wb") as f:
        f.write(b"not a journal")  # not the empty journal of a kill: refused, not hidden
    with pytest.raises((CorruptData, UnsafeRecovery)):
        controller.reap_writers([])
    controller.shutdown()


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_has_task_knows_submitted_and_regenerated_tasks_only(tmp_path, transport):
    """The controller asks once per accepted group it looks at whether that group's prompt was
    submitted again (take_groups): a point lookup, true only for a task the queue holds."""
    from vime.queue.memory_queue import MemoryRolloutQueue
    from vime.queue.rollout_queue import StrawRolloutQueue
    from vime.queue.tasks import PromptTask

    if transport == "straw":
        queue = StrawRolloutQueue.open(StoreOptions(str(tmp_path / "queue"), "run"), owner="test", lease_seconds=60)
    else:
        queue = MemoryRolloutQueue(lease_seconds=60)
    tasks = [PromptTask(f"task-{i}", i, 0, i) for i in range(3)]
    queue.submit(tasks, {"epoch": 0, "offset": 3, "next_group_index": 3})
    assert all(queue.has_task(t.task_id) for t in tasks)
    assert not queue.has_task("task-3") and not queue.has_task("")
    again = tasks[1].regenerated(7)
    assert not queue.has_task(again.task_id)
    queue.regenerate(again, request_id="regenerate-7")
    assert queue.has_task(again.task_id)
    if transport == "straw":
        queue.close()
