"""Failed tasks and their recovery on a real straw queue: `vime queue inspect` lists each failed task
with its last failure reason (replayed from the journal as straw counts attempts), and `vime queue
retry-failed` returns them to the queue as fresh prompts with a new attempt budget — on a stopped
run under the queue's fence, on a live run through the controller actor — once, never the rejected
ones, and a retried prompt is accepted (so trained) once."""

import json
import os
import time

import pytest
from straw import TaskSpec

from tests.controller_spec import completed_group, controller_spec
from tests.local_ray import local_ray
from vime.queue.memory_queue import MemoryRolloutQueue
from vime.queue.rollout_queue import StoreOptions, StrawRolloutQueue
from vime.queue.tasks import INTERRUPTION_ATTEMPTS, LEASE_EXPIRED, PromptTask
from vime.queue.transport import StrawTransport
from vime.tools import queue_cli
from vime.workers.controller import Controller

pytestmark = pytest.mark.integration

RUN_ID = "vime"  # the queue CLI's default --rollout-queue-run-id
BROKEN = "engine http://127.0.0.1:1/generate: connection refused (attempt {})"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i:03d}=", "label": str(i)}) + "\n" for i in range(10)))
    return str(path)


def make_spec(tmp_path, prompts, transport="straw"):
    return controller_spec(
        tmp_path, prompts, transport=transport, store=StoreOptions(str(tmp_path / "queue"), RUN_ID, 1.0)
    )


def call(target, method, *args):
    """A controller call, in-process or on a Ray actor."""
    if isinstance(target, Controller):
        return getattr(target, method)(*args)
    import ray

    return ray.get(getattr(target, method).remote(*args), timeout=60)


def lease_task(controller, task_id: str):
    """Lease ``task_id`` (the other tasks leased on the way go back untouched: no attempt spent)."""
    for _ in range(20):
        items = call(controller, "lease", "w", 4)
        wanted = [i for i in items if i.assignment.task.task_id == task_id]
        for item in items:
            if item not in wanted:
                call(controller, "return_partial", item.assignment.lease, item.assignment.task, None)
        if wanted:
            return wanted[0]
    raise AssertionError(f"{task_id} was never leased")


def fail_out(controller, task_id: str, attempts: int = 3) -> None:
    """Spend every attempt of ``task_id`` the way a broken engine does."""
    for i in range(attempts):
        assert call(controller, "fail", lease_task(controller, task_id).assignment.lease, BROKEN.format(i))


def accept(tmp_path, controller, item) -> int:
    lease, task = item.assignment.lease, item.assignment.task
    samples = completed_group(task, 1)
    sid = f"{lease.task_id}-{lease.attempt_id}"
    ref = StrawTransport(StoreOptions(str(tmp_path / "queue"), RUN_ID)).publish(
        samples, task_id=lease.task_id, attempt_id=lease.attempt_id, submission_id=sid
    )
    return controller.complete(lease, sid, ref, 2, 2, 0)


@pytest.fixture
def stopped_run(tmp_path, prompts):
    """A stopped run's queue: g000000000 failed by a broken engine, g000000001 rejected by the
    dynamic filter."""
    controller = Controller(make_spec(tmp_path, prompts))
    fail_out(controller, "g000000000")
    assert controller.reject(lease_task(controller, "g000000001").assignment.lease, "zero_std_1.0")
    controller.shutdown()
    return str(tmp_path / "queue")


def test_inspect_lists_failed_tasks_with_their_last_reason(stopped_run, capsys):
    report = queue_cli.inspect(stopped_run, None, RUN_ID)
    assert report["counts"]["failed"] == 1 and report["counts"]["rejected"] == 1 and report["counts"]["retried"] == 0
    assert report["failed_tasks"] == [
        {
            "task_id": "g000000000",
            "prompt_index": 0,
            "group_index": 0,
            "epoch": 0,
            "attempts": 3,
            "max_attempts": 3,
            "reason": BROKEN.format(2),
        }
    ]
    assert queue_cli.main(["inspect", "--rollout-data-dir", stopped_run]) == 0
    out = capsys.readouterr().out
    assert f"g000000000  prompt 0  3/3 attempts  {BROKEN.format(2)}" in out and "vime queue retry-failed" in out
    assert queue_cli.main(["inspect", "--rollout-data-dir", stopped_run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failed_tasks"] == report["failed_tasks"]


def dataset_cursor(data_dir: str):
    from vime.queue.journal_view import JournalView

    return [e["producer_state"] for e in JournalView.read(data_dir).of_type("Submitted") if e.get("producer_state")][-1]


def test_retry_failed_on_a_stopped_run_requeues_once_and_the_prompt_is_accepted_once(
    tmp_path, prompts, stopped_run, capsys
):
    cursor = dataset_cursor(stopped_run)
    assert queue_cli.main(["retry-failed", "--rollout-data-dir", stopped_run]) == 0
    out = capsys.readouterr().out
    assert "retried 1 failed task(s)" in out and "(prompt indices 0)" in out
    assert "1 rejected task(s) stay rejected" in out
    assert dataset_cursor(stopped_run) == cursor  # a retry is not a new prompt of the dataset
    report = queue_cli.inspect(stopped_run, None, RUN_ID)
    assert report["failed_tasks"] == []
    assert (report["counts"]["failed"], report["counts"]["retried"], report["counts"]["rejected"]) == (0, 1, 1)

    assert queue_cli.main(["retry-failed", "--rollout-data-dir", stopped_run, "--json"]) == 0  # idempotent
    assert json.loads(capsys.readouterr().out) == {"retried": [], "rejected": 1}
    assert queue_cli.main(["retry-failed", "--rollout-data-dir", stopped_run]) == 0
    assert "no failed task to retry" in capsys.readouterr().out

    # The run resumes: the retry is a fresh prompt with a whole new attempt budget, and its accepted
    # group is the prompt's only one (the failed task never had one).
    controller = Controller(make_spec(tmp_path, prompts))
    status = controller.queue.coordinator.task_status("g000000000.retry1")
    assert (status["state"], status["failures"], status["spec"]["max_attempts"]) == (
        "pending",
        0,
        INTERRUPTION_ATTEMPTS,
    )
    assert controller.queue.sample_failures["g000000000.retry1"] == 0
    item = lease_task(controller, "g000000000.retry1")
    assert (item.prompt.index, item.assignment.task.stage) == (0, "fresh")
    accept(tmp_path, controller, item)
    taken = controller.take_groups(0, 100, 0, 0, allow_partial=True).groups
    assert [g.task_id for g in taken] == ["g000000000.retry1"]
    controller.shutdown()
    from vime.queue.journal_view import JournalView

    assert [g.task_id for g in JournalView.read(stopped_run).accepted()] == ["g000000000.retry1"]
    assert queue_cli.inspect(stopped_run, None, RUN_ID)["counts"]["retried"] == 1


@pytest.mark.parametrize("transport", ["straw", "object-store"])
def test_controller_retries_every_round_of_failures_and_never_the_rejected(tmp_path, prompts, transport):
    controller = Controller(make_spec(tmp_path, prompts, transport))
    fail_out(controller, "g000000000")
    fail_out(controller, "g000000002")
    assert controller.reject(lease_task(controller, "g000000001").assignment.lease, "zero_std_0.0")
    report = controller.retry_failed()
    assert [(old, new.task_id, new.prompt_index) for old, new in report.retried] == [
        ("g000000000", "g000000000.retry1", 0),
        ("g000000002", "g000000002.retry1", 2),
    ]
    assert report.rejected == 1
    assert controller.retry_failed().retried == []  # a second call retries nothing
    fail_out(controller, "g000000000.retry1")  # the engine is still broken
    assert [t.task.task_id for t in controller.queue.failed() if not t.rejected] == ["g000000000.retry1"]
    assert [new.task_id for _, new in controller.retry_failed().retried] == ["g000000000.retry2"]
    controller.shutdown()


def test_interrupted_attempts_spend_nothing_and_failed_calls_are_counted_across_restarts(tmp_path):
    """Expired leases (a dead or hung worker) and leases revoked by controller restarts return the
    prompt to the queue without spending an attempt, however many there are; the sample's own
    failures are counted across restarts (rebuilt from the journal) and the third ends the task
    failed. The journal replay of `vime queue inspect` agrees with the queue."""
    lease_seconds = 2.0
    options = StoreOptions(str(tmp_path / "queue"), RUN_ID)
    queue = StrawRolloutQueue.open(options, owner="first", lease_seconds=lease_seconds)
    queue.submit([PromptTask.make(i, 0, i) for i in range(2)], {"epoch": 0, "offset": 2, "next_group_index": 2})

    def lease(task_id):
        return queue.coordinator.acquire("w", 1, task_ids=[task_id]).assignments[0].lease

    lease("g000000000")
    time.sleep(lease_seconds + 0.5)  # expired: the worker died
    queue.fail(lease("g000000001"), "boom 1", request_id="f1")
    for restart in range(4):  # every restart revokes both leases
        lease("g000000000")
        lease("g000000001")
        queue.close()
        queue = StrawRolloutQueue.open(options, owner=f"restart-{restart}", lease_seconds=lease_seconds)
    assert queue.failed() == []
    statuses = {t: queue.coordinator.task_status(t)["state"] for t in ("g000000000", "g000000001")}
    assert statuses == {"g000000000": "pending", "g000000001": "pending"}
    assert queue.sample_failures["g000000001"] == 1  # rebuilt from the journal
    queue.fail(lease("g000000001"), "boom 2", request_id="f2")
    assert queue.failed() == []
    queue.fail(lease("g000000001"), "boom 3", request_id="f3")
    truth = [(f.task.task_id, f.failures, f.reason) for f in queue.failed()]
    assert truth == [("g000000001", 3, "boom 3")]
    assert queue.coordinator.task_status("g000000001")["state"] == "failed"
    queue.close()
    report = queue_cli.inspect(options.data_dir, None, RUN_ID)
    assert [(t["task_id"], t["attempts"], t["max_attempts"], t["reason"]) for t in report["failed_tasks"]] == [
        ("g000000001", 3, 3, "boom 3")
    ]
    assert report["counts"]["failed"] == 1 and report["counts"]["fresh"] == 1


def test_the_in_memory_queue_spends_no_attempt_on_an_expired_lease():
    queue = MemoryRolloutQueue(lease_seconds=0.05)
    queue.submit([PromptTask.make(0, 0, 0)], {})
    for _ in range(5):
        assert len(queue.acquire("w", 1)) == 1
        time.sleep(0.1)
    assert queue.failed() == []
    for attempt in range(3):
        queue.fail(queue.acquire("w", 1)[0].lease, f"boom {attempt}", request_id=str(attempt))
    assert [(f.task.task_id, f.failures, f.reason) for f in queue.failed()] == [("g000000000", 3, "boom 2")]


def test_inspect_counts_attempts_of_an_older_journal_as_straw_did(tmp_path):
    """Tasks an older vime submitted with straw's default budget (3): a failed call, an expired lease
    and a lease revoked by a restart each spent an attempt, and the journal replay lists the same
    failed tasks, attempts and reasons as straw itself."""
    # Long enough that no lease but the one meant to expire does (every call here writes the journal,
    # which takes a while on a loaded machine); the sleep outlasts it.
    lease_seconds = 4.0
    options = StoreOptions(str(tmp_path / "queue"), RUN_ID)
    queue = StrawRolloutQueue.open(options, owner="first", lease_seconds=lease_seconds)
    queue.coordinator.submit_tasks(
        "s",
        [
            TaskSpec(t, metadata={"group_index": i, "epoch": 0, "prompt_index": i}, allow_empty=True, max_attempts=3)
            for i, t in enumerate("abc")
        ],
    )
    c = queue.coordinator
    c.fail_task(c.acquire("w", 1, task_ids=["a"]).assignments[0].lease, request_id="f1", failure="boom")
    lease = c.acquire("w", 1, task_ids=["a"]).assignments[0].lease
    time.sleep(lease_seconds + 0.5)
    assert c.heartbeat([lease]) != ["extended"]  # a's lease expired
    for request in ("f2", "f3"):
        c.fail_task(c.acquire("w", 1, task_ids=["b"]).assignments[0].lease, request_id=request, failure="boom")
    assert len(c.acquire("w", 2, task_ids=["a", "b"]).assignments) == 2
    queue.close()
    queue = StrawRolloutQueue.open(options, owner="second", lease_seconds=lease_seconds)  # a restart: a and b revoked
    truth = [(f.task.task_id, f.failures, f.reason) for f in queue.failed()]
    queue.close()
    assert truth == [("a", 3, LEASE_EXPIRED), ("b", 3, "boom")]
    listed = queue_cli.inspect(options.data_dir, None, RUN_ID)["failed_tasks"]
    assert [(t["task_id"], t["attempts"], t["reason"]) for t in listed] == truth


def test_retry_failed_refuses_a_queue_a_live_controller_holds(tmp_path, prompts, capsys):
    controller = Controller(make_spec(tmp_path, prompts))
    fail_out(controller, "g000000000")
    data_dir = str(tmp_path / "queue")
    assert queue_cli.main(["retry-failed", "--rollout-data-dir", data_dir]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--rollout-data-dir {data_dir}: a live run drives this queue" in err
    assert "vime queue retry-failed --run RUN_DIR` on the live run" in err and '"pid": ' in err
    controller.shutdown()
    assert [t["task_id"] for t in queue_cli.inspect(data_dir, None, RUN_ID)["failed_tasks"]] == ["g000000000"]


def test_retry_failed_names_the_flag_on_bad_input(tmp_path, capsys):
    def refused(argv, code, text):
        assert queue_cli.main(argv) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("vime queue retry-failed: error: ") and text in err, err

    refused(
        ["retry-failed", "--rollout-data-dir", str(tmp_path / "nothing")],
        2,
        f"--rollout-data-dir {tmp_path / 'nothing'} does not exist",
    )
    refused(["retry-failed", "--rollout-data-dir", str(tmp_path)], 2, f"--rollout-data-dir {tmp_path} holds no queue")
    refused(["retry-failed", "--run", str(tmp_path / "nothing")], 2, f"--run {tmp_path / 'nothing'} does not exist")
    refused(["retry-failed", "--run", str(tmp_path)], 1, "run.json does not exist")
    (tmp_path / "run.json").write_text(
        json.dumps({"pid": 2**22 + 12345, "ray_address": "127.0.0.1:1", "ray_namespace": "vime-x"})
    )
    refused(["retry-failed", "--run", str(tmp_path)], 1, "is not running")
    with pytest.raises(SystemExit) as exit_:
        queue_cli.main(["retry-failed"])
    assert exit_.value.code == 2
    assert "one of the arguments --rollout-data-dir --run is required" in capsys.readouterr().err


def test_retry_failed_on_a_live_run_goes_through_the_named_controller_actor(tmp_path, prompts, capsys):
    import ray

    namespace = "vime-retry-test"
    with local_ray(namespace=namespace):
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "run.json").write_text(
            json.dumps(
                {"pid": os.getpid(), "ray_namespace": namespace, "ray_address": ray.get_runtime_context().gcs_address}
            )
        )
        assert queue_cli.main(["retry-failed", "--run", str(run_dir)]) == 1
        assert "the run has no controller reachable by name" in capsys.readouterr().err
        # Created as vime/train.py creates it: named, restartable.
        controller = ray.remote(num_cpus=0, max_restarts=10, max_task_retries=-1, name=Controller.ACTOR_NAME)(
            Controller
        ).remote(make_spec(tmp_path, prompts))
        fail_out(controller, "g000000000")
        assert queue_cli.main(["retry-failed", "--rollout-data-dir", str(tmp_path / "queue")]) == 1  # it is live
        assert "--run RUN_DIR" in capsys.readouterr().err
        assert queue_cli.main(["retry-failed", "--run", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert "retried 1 failed task(s)" in out and "(prompt indices 0)" in out
        assert queue_cli.main(["retry-failed", "--run", str(run_dir)]) == 0
        assert "no failed task to retry" in capsys.readouterr().out
        item = lease_task(controller, "g000000000.retry1")  # the live run leases it like any fresh prompt
        assert item.prompt.index == 0
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
