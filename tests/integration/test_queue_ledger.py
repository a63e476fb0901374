"""The ledger of `vime queue inspect` (tools/ledger.py) on real straw queues built by the real controller:
generated = trained + waiting + discarded by cause, whole run and per lineage, and a broken state (a group
trained twice, a group lost, trained groups nobody generated) reported as not closing."""

import json
import os

import pytest

from tests.controller_spec import completed_group, controller_spec, group_to_publish, write_prompts
from vime.queue.gc import group_submission_id, partial_submission_id
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import StrawTransport
from vime.recovery.checkpoint import CheckpointState, save_checkpoint
from vime.recovery.lineage import Lineage
from vime.tools import queue_cli
from vime.workers.controller import Controller, ControllerSpec

pytestmark = pytest.mark.integration

RUN_ID = "vime"  # the queue CLI's default --rollout-queue-run-id
RESPONSE = 3  # response tokens of each sample; two samples a group


@pytest.fixture
def run(tmp_path):
    """A controller over a real straw queue in tmp_path/queue, and a rollout worker's writer for it."""
    prompts = write_prompts(tmp_path, 12)
    spec = controller_spec(tmp_path, prompts, store=StoreOptions(str(tmp_path / "queue"), RUN_ID, 1.0))
    return Run(spec)


class Run:
    def __init__(self, spec: ControllerSpec):
        self.spec, self.data_dir = spec, spec.store.data_dir
        self.controller = Controller(spec)
        self.transport = StrawTransport(StoreOptions(self.data_dir, RUN_ID))
        self.worker = f"worker@{self.transport.writer_id}"  # as rollout workers lease: name@straw writer

    def lease(self, task_id: str | None = None):
        for _ in range(20):
            items = self.controller.lease(self.worker, 1)
            if items and (task_id is None or items[0].assignment.task.task_id == task_id):
                return items[0]
            for item in items:
                self.controller.return_partial(item.assignment.lease, item.assignment.task, None)
        raise AssertionError(f"{task_id} was never leased")

    def publish(self, item, version: int):
        lease, task = item.assignment.lease, item.assignment.task
        samples = completed_group(task, RESPONSE, version)
        sid = f"{lease.task_id}-{lease.attempt_id}"
        return sid, self.transport.publish(
            samples, task_id=lease.task_id, attempt_id=lease.attempt_id, submission_id=sid
        )

    def accept(self, version: int = 0, task_id: str | None = None) -> int:
        item = self.lease(task_id)
        sid, ref = self.publish(item, version)
        return self.controller.complete(item.assignment.lease, sid, ref, 2, 2 * RESPONSE, version)

    def train(
        self,
        step: int,
        cursor: int,
        count: int,
        version: int,
        lineage: Lineage | None = None,
        step_cursors: list[int] | None = None,
        skipped: list[int] | None = None,
    ):
        taken = self.controller.take_groups(cursor, count, version, cursor, allow_partial=True, lineage=lineage)
        skipped = (skipped or []) + taken.skipped
        step_cursors = (step_cursors or []) + [taken.next_cursor]
        self.controller.commit(step, taken.next_cursor, step_cursors, skipped)
        return taken, step_cursors, skipped

    def close(self) -> None:
        self.controller.shutdown()
        self.transport.close()


def ledger(data_dir: str, save: str | None = None) -> dict:
    return queue_cli.inspect(data_dir, save, RUN_ID)["ledger"]


def groups(books: dict, row: dict | None = None) -> dict:
    return (row or books["run"])["groups"]


def test_a_clean_run_closes_with_filtered_failed_and_waiting_groups(run, capsys):
    for _ in range(3):
        run.accept()
    run.train(1, 0, 2, 0)  # two trained, one waiting
    assert run.controller.reject(run.lease().assignment.lease, "zero_std_0.0")  # the dynamic filter's verdict
    failing = run.lease()
    for attempt in range(3):  # the sample's own failures spend the task's attempts
        assert run.controller.fail(failing.assignment.lease, f"reward raised ({attempt})")
        if attempt < 2:
            failing = run.lease(failing.assignment.task.task_id)
    run.close()
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert groups(books) == {
        "generated": 5,
        "trained": 2,
        "waiting": 1,
        "discarded": 2,
        "stale": 0,
        "lost_with_lineage": 0,
        "filtered": 1,
        "failed": 1,
        "released_orphan": 0,
        "unaccounted": 0,
    }
    tokens = books["run"]["tokens"]  # filtered and failed groups leave no payload: no tokens on disk
    assert (tokens["generated"], tokens["trained"], tokens["waiting"]) == (6 * RESPONSE, 4 * RESPONSE, 2 * RESPONSE)
    assert books["run"]["tokens_unknown"] == 2 and books["trained_twice"] == 0
    [lineage0, no_payload] = books["lineages"]
    assert groups(books, lineage0)["generated"] == 3 and groups(books, no_payload)["generated"] == 2
    assert queue_cli.main(["inspect", "--rollout-data-dir", run.data_dir]) == 0
    out = capsys.readouterr().out
    assert "ledger closes: 5 generated = 2 trained + 1 waiting + 2 discarded; none trained twice" in out
    assert queue_cli.main(["inspect", "--rollout-data-dir", run.data_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ledger"] == books
    # each trained group names the lease it was accepted under (its writer) and the pack that holds its payload
    assert [g["written_by"] for g in report["trained_groups"]] == [run.worker] * 2
    assert all(os.path.isfile(os.path.join(run.data_dir, g["pack"])) for g in report["trained_groups"])


def test_stale_groups_are_discarded_by_cause_and_their_prompts_trained_once(run):
    first, second = run.accept(version=0), run.accept(version=0)
    taken, cursors, skipped = run.train(1, 0, 2, version=5)  # 5 steps newer than the tokens: --max-staleness 1
    assert taken.groups == [] and skipped == [first, second]
    regenerated = [run.accept(version=5, task_id=f"r{p:09d}") for p in skipped]
    run.train(2, taken.next_cursor, 2, version=5, step_cursors=cursors, skipped=skipped)
    run.close()
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["trained"], groups(books)["stale"]) == (4, 2, 2)
    assert books["run"]["tokens"]["stale"] == 2 * 2 * RESPONSE
    assert regenerated == [2, 3]


def test_groups_of_a_lineage_lost_to_a_restore_are_lost_with_it_and_the_ledger_closes(run):
    run.accept(version=0)
    run.accept(version=1)
    _, cursors, skipped = run.train(1, 0, 2, version=1)
    lost = run.accept(version=2)  # generated by step 2's weights: the trainer dies in step 3
    # Restored in place from the checkpoint of step 1 (version 1), published as version 3: version 2 is lost.
    lineage = Lineage().restored(step=1, restored_version=1, new_version=3)
    kept = run.accept(version=3)
    taken, _, skipped = run.train(2, cursors[-1], 1, version=3, lineage=lineage, step_cursors=cursors, skipped=skipped)
    assert [g.position for g in taken.groups] == [kept] and skipped == [lost]
    run.close()
    # No --save: the lineage comes from the queue's committed state.
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["trained"], groups(books)["lost_with_lineage"], groups(books)["stale"]) == (3, 1, 0)
    first, second, _ = books["lineages"]
    assert first["lost_versions"] == [2, 2] and second["restored_step"] == 1 and second["first_version"] == 3
    assert (groups(books, first)["trained"], groups(books, first)["lost_with_lineage"]) == (2, 1)
    assert (groups(books, second)["generated"], groups(books, second)["trained"]) == (1, 1)
    assert all(row["balance"] == 0 for row in books["lineages"])


def test_a_group_published_but_never_accepted_is_a_released_orphan(run, tmp_path):
    run.accept()
    item = run.lease()
    run.publish(item, 0)  # the worker dies before asking for acceptance
    run.close()
    books = ledger(run.data_dir)
    assert books["in_flight"] >= 1 and groups(books)["released_orphan"] == 0  # its lease is still on
    Controller(run.spec).shutdown()  # a new controller revokes the dead run's leases
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["waiting"], groups(books)["released_orphan"]) == (2, 1, 1)
    assert books["run"]["tokens"]["released_orphan"] == 2 * RESPONSE


@pytest.mark.parametrize("accepted", [0, 1])
def test_groups_published_together_and_never_accepted_are_released_orphans(run, accepted):
    """A rollout worker publishes the groups that finished together in one straw publication, under its first
    group's id (workers/group_publisher.py). It dies after one of three was accepted (the first, or the second):
    the two others are found (under the first's id, or by their own when their group led), counted as released
    orphans, and released by the next controller's reap; the accepted one stays the queue's."""
    items = [run.lease() for _ in range(3)]
    groups_ = [group_to_publish(item, RESPONSE) for item in items]
    refs = run.transport.publish_groups(groups_)
    kept = items[accepted].assignment.lease
    assert run.controller.complete(kept, groups_[accepted].submission_id, refs[accepted], 2, 2 * RESPONSE, 0) == 0
    run.close()
    Controller(run.spec).shutdown()  # a new controller revokes the dead run's leases
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["waiting"], groups(books)["released_orphan"]) == (3, 1, 2)
    controller = Controller(run.spec)
    try:
        assert controller.reap_writers([])["publications_released"] == 2
        assert list(controller.queue.store.read(refs[accepted]))  # the accepted group is still whole
    finally:
        controller.shutdown()


@pytest.fixture
def long_run(tmp_path):
    """``run`` with room for a dozen groups outstanding: a worker that leases on while nothing is trained."""
    prompts = write_prompts(tmp_path, 12)
    store = StoreOptions(str(tmp_path / "queue"), RUN_ID, 1.0)
    return Run(controller_spec(tmp_path, prompts, store=store, max_staleness=10))


@pytest.fixture
def receipt_lookups(monkeypatch):
    """Every straw receipt lookup the reaping makes (each reads the writer's whole record of publications, so how
    many there are is what a reap costs: tests below count them); the real lookup answers each."""
    from vime.queue import gc

    made: list[str] = []
    real = gc.publication_receipt

    def counted(store, writer, submission, deadline, *args):
        made.append(submission)
        return real(store, writer, submission, deadline, *args)

    monkeypatch.setattr(gc, "publication_receipt", counted)
    return made


def test_a_dead_writer_s_reap_looks_up_only_the_attempts_whose_outcome_is_unknown(long_run, receipt_lookups):
    run = long_run
    """A long-lived worker's accepted groups and continued prefixes are the queue's: its reap looks none of them up.
    What it left unaccepted (a group published behind an accepted one, then the worker died) is found through the
    one leader accepted after that group was leased, and released; the leader stays the queue's."""
    for _ in range(6):
        run.accept()
    continued = run.lease()
    lease, task = continued.assignment.lease, continued.assignment.task
    prefix = run.transport.publish(
        completed_group(task, RESPONSE), task_id=lease.task_id, attempt_id=lease.attempt_id,
        submission_id=partial_submission_id(lease.task_id, lease.attempt_id),
    )  # fmt: skip
    assert run.controller.return_partial(lease, task.as_continuation(0), prefix)
    leader, follower = run.lease(), run.lease()
    together = [group_to_publish(item, RESPONSE) for item in (leader, follower)]
    refs = run.transport.publish_groups(together)
    assert run.controller.complete(leader.assignment.lease, together[0].submission_id, refs[0], 2, 2 * RESPONSE, 0)
    run.close()  # the worker dies before asking for the follower's acceptance
    controller = Controller(run.spec)  # revokes the dead run's leases
    try:
        assert controller.reap_writers([])["publications_released"] == 1
        follower_key = (follower.assignment.lease.task_id, follower.assignment.lease.attempt_id)
        assert receipt_lookups == [
            partial_submission_id(*follower_key),
            group_submission_id(*follower_key),
            together[0].submission_id,  # the only group accepted after the follower was leased
        ]
        assert list(controller.queue.store.read(refs[0]))  # the accepted leader is still whole
    finally:
        controller.shutdown()


def test_a_group_its_worker_ended_before_a_later_acceptance_is_not_looked_up(long_run, receipt_lookups):
    """A group the worker failed itself (or gave back untouched) left nothing behind once the worker went on to
    publish a group that was accepted (it gives up a payload whose hand-over raised, and a failed publication goes
    before its next one): only the group it failed after its last accepted lease is looked for."""
    run = long_run
    early = run.lease()
    assert run.controller.fail(early.assignment.lease, "the reward raised")
    given_back = run.lease()
    assert run.controller.return_partial(given_back.assignment.lease, given_back.assignment.task, None)
    for _ in range(3):
        run.accept()
    last = run.lease()
    assert run.controller.fail(last.assignment.lease, "the reward raised")
    run.close()
    controller = Controller(run.spec)
    try:
        assert controller.reap_writers([])["publications_released"] == 0
        last_key = (last.assignment.lease.task_id, last.assignment.lease.attempt_id)
        assert receipt_lookups == [partial_submission_id(*last_key), group_submission_id(*last_key)]
    finally:
        controller.shutdown()


def test_a_writer_is_reaped_once(run, receipt_lookups):
    """Every worker's death asks for a reap of every dead writer: one reaped before is skipped (vime's record in the
    queue's folder), unless the record of it was cut short by a crash."""
    from vime.queue.gc import REAPED_FILE

    item = run.lease()
    run.publish(item, 0)  # the worker dies before asking for acceptance
    run.close()
    controller = Controller(run.spec)
    try:
        first = controller.reap_writers([])  # the worker's writer and the first controller's
        assert (first["writers_retired"], first["publications_released"], first["writers_reaped_before"]) == (2, 1, 0)
        made = len(receipt_lookups)
        again = controller.reap_writers([])
        assert (again["writers_retired"], again["writers_reaped_before"]) == (0, 2)
        assert len(receipt_lookups) == made  # nothing looked up again
        record = os.path.join(run.data_dir, REAPED_FILE)
        with open(record) as f:
            lines = f.read().splitlines()
        assert f"{run.transport.writer_id} in-run" in lines and len(lines) == 2
        others = [line for line in lines if not line.startswith(run.transport.writer_id)]
        with open(record, "w") as f:
            f.write("".join(f"{line}\n" for line in others) + run.transport.writer_id[:10])  # a crash mid-line
        assert controller.reap_writers([])["writers_retired"] == 1  # reaped again: releasing again is harmless
    finally:
        controller.shutdown()


def test_the_run_s_reaping_leaves_a_lease_the_queue_ended_earlier_to_vime_queue_gc(long_run, receipt_lookups):
    """A restarted controller revokes the leases in flight; the worker goes on and has groups accepted. A group of a
    revoked lease it published in the moment before it died is not looked for by the run's own reaping, which must
    not hold up the queue reading the worker's whole life; `vime queue gc` after the run finds and releases it."""
    from vime.queue.gc import collect_stopped

    run = long_run
    revoked = run.lease()
    run.controller.shutdown()
    run.controller = Controller(run.spec)  # the restart revokes the lease
    for _ in range(3):
        run.accept()
    run.publish(revoked, 0)  # published late, and the worker died before giving it up
    run.close()
    controller = Controller(run.spec)
    try:
        in_run = controller.reap_writers([])
    finally:
        controller.shutdown()
    assert in_run["publications_released"] == 0
    revoked_key = (revoked.assignment.lease.task_id, revoked.assignment.lease.attempt_id)
    assert group_submission_id(*revoked_key) not in receipt_lookups
    after = collect_stopped(run.data_dir, RUN_ID)
    assert after["publications_released"] == 1 and group_submission_id(*revoked_key) in receipt_lookups


def test_a_group_published_beside_an_orphan_is_not_one_while_its_attempt_is_on(run):
    """Two groups in one publication: the first's lease moved on (its group went back to the queue), the second's is
    still on. The first is a released orphan; the second, found in the same receipt, may yet be accepted."""
    first, second = run.lease(), run.lease()
    run.transport.publish_groups([group_to_publish(item, RESPONSE) for item in (first, second)])
    run.controller.return_partial(first.assignment.lease, first.assignment.task, None)
    run.close()
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["released_orphan"]) == (1, 1)


def test_a_writer_killed_while_its_journal_was_created_published_nothing(run):
    """A SIGKILL can land between a producer creating its straw journal and writing its first transaction
    (seen in the random-kill fault test): straw refuses to read such a writer's receipts, and there is
    nothing to read: its leased attempt returned to the queue with nothing published."""
    run.accept()
    unstarted = StrawTransport(StoreOptions(run.data_dir, RUN_ID))
    unstarted.publish([], task_id="x", attempt_id="y", submission_id="z")  # creates its journal
    writer = unstarted.store.writer_id
    run.worker = f"worker@{writer}"
    run.lease()  # the lease it held when it was killed
    journal = os.path.join(
        run.data_dir, "control", "writers", writer[:2], writer, "operations", "control", "journal.log"
    )
    open(journal, "w").close()  # what the kill left: the journal created, nothing in it
    run.close()
    Controller(run.spec).shutdown()  # a new controller revokes the dead run's leases
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["released_orphan"]) == (1, 0)


def test_a_worker_killed_before_its_first_publication_published_nothing(run):
    """straw creates a writer's directory at its first publication: a producer killed after leasing and before
    publishing anything (seen in the random-kill fault test) has none, and straw refuses to be asked about it."""
    run.accept()
    run.worker = "worker@" + "0" * 32  # a writer id that never published
    run.lease()
    run.close()
    Controller(run.spec).shutdown()  # a new controller revokes the dead run's leases
    books = ledger(run.data_dir)
    assert books["closes"], books
    assert (groups(books)["generated"], groups(books)["released_orphan"]) == (1, 0)


def checkpoint(save: str, *, cursor: int, step_cursors: list[int], skipped: list[int]) -> None:
    state = CheckpointState(
        schema=1,
        step=len(step_cursors),
        weight_version=len(step_cursors),
        consumer_cursor=cursor,
        run_options={},
        step_cursors=step_cursors,
        skipped=skipped,
    )
    save_checkpoint(save, state, lambda path: os.makedirs(path))


def test_a_broken_lineage_state_does_not_close(run, tmp_path, capsys):
    stale = run.accept(version=0)
    taken, cursors, skipped = run.train(1, 0, 1, version=5)
    assert skipped == [stale]
    again = run.accept(version=5, task_id=f"r{stale:09d}")
    fresh = run.accept(version=5)
    run.train(2, taken.next_cursor, 2, version=5, step_cursors=cursors, skipped=skipped)
    run.close()
    save = str(tmp_path / "save")
    checkpoint(save, cursor=fresh + 1, step_cursors=[1, fresh + 1], skipped=[stale])
    assert ledger(run.data_dir, save)["closes"]  # the truth closes ...

    # ... a checkpoint that forgot the skip trains the stale group and its regeneration: the prompt twice
    checkpoint(save, cursor=fresh + 1, step_cursors=[1, fresh + 1], skipped=[])
    books = ledger(run.data_dir, save)
    assert not books["closes"] and books["trained_twice"] == 1 and books["run"]["balance"] == 0
    assert queue_cli.main(["inspect", "--rollout-data-dir", run.data_dir, "--save", save]) == 0  # exit unchanged
    assert "ledger does NOT close: 1 groups trained twice in the surviving lineage" in capsys.readouterr().out

    # ... one that skips a group whose prompt was never submitted again loses it
    checkpoint(save, cursor=fresh + 1, step_cursors=[1, fresh + 1], skipped=[stale, fresh])
    books = ledger(run.data_dir, save)
    assert not books["closes"] and groups(books)["unaccounted"] == 1 and books["run"]["balance"] == 1
    assert queue_cli.main(["inspect", "--rollout-data-dir", run.data_dir, "--save", save]) == 0
    assert "ledger does NOT close: 1 groups unaccounted for" in capsys.readouterr().out

    # ... one whose cursor runs past the accepted groups trained groups nobody generated
    checkpoint(save, cursor=fresh + 3, step_cursors=[1, fresh + 3], skipped=[stale])
    books = ledger(run.data_dir, save)
    assert not books["closes"] and books["phantom_trained"] == 2 and books["run"]["balance"] == -2
    assert again == 1
