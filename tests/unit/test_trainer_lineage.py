"""A trainer restored in place (workers/trainer_restart.py): which versions are lost (recovery/lineage.py),
how the controller treats groups that carry them, and what a checkpoint keeps. The whole path, with real
SIGKILLs, is tests/faults/test_trainer_restart.py."""

import json

import msgspec
import pytest

from tests.controller_spec import controller_spec, write_prompts
from tests.train_args import minimal_train_argv
from vime.config import ConfigError, parse_train_args
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import StrawTransport
from vime.recovery.checkpoint import CheckpointState, load_state, save_checkpoint
from vime.recovery.lineage import Lineage, resumed
from vime.sample import Sample, Status
from vime.workers.controller import Controller


def test_versions_of_lost_steps_are_lost_and_staleness_counts_steps():
    # Trained to version 6 (one version per step), died; restored from the checkpoint of step 4 (version 4)
    # and published as version 7.
    lineage = Lineage().restored(step=4, restored_version=4, new_version=7)
    assert [v for v in range(10) if lineage.lost(v)] == [5, 6]
    assert lineage.newest_lost == 6
    assert [lineage.step_of(v) for v in (0, 4, 7, 8)] == [0, 4, 4, 5]
    assert lineage.staleness(8, 4) == 1  # the jump in numbering is no step
    # Died again at version 9, restored to step 4 once more: 7 and 8 (the first restore's lineage) are lost too.
    again = lineage.restored(step=4, restored_version=4, new_version=10)
    assert [v for v in range(12) if again.lost(v)] == [5, 6, 7, 8, 9]
    assert again.step_of(11) == 5 and again.staleness(11, 3) == 2
    # From the initial weights (no checkpoint yet): every trained version is lost.
    initial = Lineage().restored(step=0, restored_version=0, new_version=3)
    assert [v for v in range(5) if initial.lost(v)] == [1, 2] and initial.step_of(3) == 0
    with pytest.raises(ValueError, match="versions only increase"):
        lineage.restored(step=4, restored_version=4, new_version=7)


def test_a_checkpoint_keeps_the_lineage_and_old_ones_still_load(tmp_path):
    lineage = Lineage().restored(step=2, restored_version=2, new_version=5)
    state = CheckpointState(
        schema=1, step=3, weight_version=6, consumer_cursor=6, run_options={}, step_cursors=[2, 4, 6], lineage=lineage
    )
    save_checkpoint(str(tmp_path), state, lambda path: __import__("os").makedirs(path, exist_ok=True))
    assert load_state(str(tmp_path))[1].lineage == lineage
    old = {"schema": 1, "step": 1, "weight_version": 1, "consumer_cursor": 2, "run_options": {}}
    assert msgspec.json.decode(json.dumps(old), type=CheckpointState).lineage == Lineage()


def test_the_restart_budget_is_checked_naming_its_flag(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert parse_train_args(minimal_train_argv(str(tmp_path))).checkpoint.trainer_restart_budget == 3
    assert (
        parse_train_args(
            minimal_train_argv(str(tmp_path), "--trainer-restart-budget", "0")
        ).checkpoint.trainer_restart_budget
        == 0
    )
    with pytest.raises(ConfigError, match="--trainer-restart-budget"):
        parse_train_args(minimal_train_argv(str(tmp_path), "--trainer-restart-budget", "-1"))


# ---------------------------------------------------------------- the controller across a restore
@pytest.fixture
def controller(tmp_path):
    spec = controller_spec(tmp_path, write_prompts(tmp_path, 20))
    made = []

    def make():
        made.append(Controller(spec))
        return made[-1]

    yield make
    for c in made:
        c.shutdown()


def accept(tmp_path, controller, versions_per_group):
    """Lease one task per entry and accept it with samples whose tokens carry those versions."""
    leased = []
    while len(leased) < len(versions_per_group):  # the controller keeps two rollouts' worth of prompts pending
        leased += controller.lease("w", len(versions_per_group) - len(leased))
    writer = StrawTransport(StoreOptions(str(tmp_path / "queue"), "run"))
    for item, versions in zip(leased, versions_per_group):
        a = item.assignment
        samples = [
            Sample(
                group_index=a.task.group_index,
                index=i,
                prompt_index=a.task.prompt_index,
                tokens=[1] * (len(versions) + 1),
                response_length=len(versions),
                reward=1.0,
                status=Status.COMPLETED,
                weight_versions=list(versions),
            )
            for i in range(2)
        ]
        sid = f"{a.lease.task_id}-{a.lease.attempt_id}"
        ref = writer.publish(samples, task_id=a.lease.task_id, attempt_id=a.lease.attempt_id, submission_id=sid)
        controller.complete(a.lease, sid, ref, 2, len(versions) * 2, min(versions))
    writer.close()
    return leased


def test_groups_carrying_lost_versions_are_regenerated_and_the_others_trained(tmp_path, controller):
    c = controller()
    c.sync(4, 0, 0)
    # Accepted while the lost steps ran (versions 5, 6 were lost) or before (4), or after the restore (7).
    accept(tmp_path, c, [(4, 4), (4, 5), (6, 6), (3, 4), (7, 7), (4, 7)])
    lineage = Lineage().restored(step=4, restored_version=4, new_version=7)
    taken = c.take_groups(0, 4, 7, 0, lineage=lineage, allow_partial=True)
    # 1 and 2 carry tokens of lost weights; 3 is one step old for the policy at 7 (= step 4) and is trained;
    # 5 mixes version 4 with the restored 7 (the same weights, no lost token).
    assert taken.skipped == [1, 2] and [g.position for g in taken.groups] == [0, 3, 4, 5]
    regenerated = sorted(t.task_id for t in c.queue.pending() if t.task_id.startswith("r"))
    assert regenerated == ["r000000001", "r000000002"]
    # Admission counts steps: at version 7 the policy is at step 4, not 7. Room for (4 + max_staleness 1 + 1)
    # rollouts of 2 groups, less the 4 accepted groups that will still be trained (not the 2 regenerated).
    assert c.queue.counts().get("leased", 0) == 0
    assert c._admissible() == (4 + 1 + 1) * 2 - 4


def test_a_resumed_run_never_gives_out_a_version_the_run_before_did(tmp_path, controller):
    # The killed run checkpointed step 4 (version 4), then trained on and published 5 and 6: groups accepted after
    # the checkpoint's cursor (1) carry them. The newest version on the queue from the cursor on is 6.
    c = controller()
    c.sync(4, 0, 0)  # the policy the resumed run starts from (admission lets enough prompts out for five groups)
    accept(tmp_path, c, [(3, 4), (4, 4), (4, 5), (5, 6), (6,)])
    assert c.newest_token_version(1) == 6 and c.newest_token_version(4) == 6 and c.newest_token_version(5) == -1
    lineage, version = resumed(Lineage(), step=4, restored_version=4, newest_given_out=6)
    assert version == 7 and [v for v in range(9) if lineage.lost(v)] == [5, 6] and lineage.step_of(7) == 4
    taken = c.take_groups(1, 4, version, 0, lineage=lineage, allow_partial=True)
    assert taken.skipped == [2, 3, 4] and [g.position for g in taken.groups] == [1]  # 1 carries only version 4
    # Nothing newer than the checkpoint was given out: its own version, the lineage unchanged.
    assert resumed(lineage, step=4, restored_version=4, newest_given_out=4) == (lineage, 4)
    assert resumed(Lineage(), step=0, restored_version=0, newest_given_out=-1) == (Lineage(), 0)


def test_a_group_regenerated_in_a_lost_lineage_is_never_trained_in_the_surviving_one(tmp_path, controller):
    c = controller()
    accept(tmp_path, c, [(0,), (0,), (0,), (0,)])
    taken = c.take_groups(0, 2, 2, 0, allow_partial=True)  # too stale for the policy at version 2: regenerated
    assert taken.skipped == [0, 1, 2, 3] and not taken.groups
    c.shutdown()
    # The lineage is rewound (a restore to step 0, published as version 3) and the controller restarted
    # meanwhile: within the bound now, the groups already submitted again are still skipped.
    restarted = controller()
    lineage = Lineage().restored(step=0, restored_version=0, new_version=3)
    assert lineage.staleness(3, 0) == 0
    again = restarted.take_groups(0, 4, 3, 0, lineage=lineage, allow_partial=True)
    assert again.skipped == [0, 1, 2, 3] and not again.groups
    assert sum(t.task_id.startswith("r") for t in restarted.queue.pending()) == 4  # submitted once, not twice
