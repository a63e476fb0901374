"""--save-retain-last / --save-retain-interval (recovery/retention.py) on real checkpoint folders: what is
kept, what is never deleted, and a deletion SIGKILLed half-way leaving --load and --ckpt-step working."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.train_args import minimal_train_argv
from vime.config import ConfigError, parse_train_args
from vime.recovery import checkpoint as ckpt
from vime.recovery.retention import RetentionPolicy, doomed_steps, prune_checkpoints

FILES_PER_CHECKPOINT = 4  # and vime_state.json


def write_trainer_state(folder: str) -> None:
    """What a trainer writes: files in sub-folders (model shards, optimizer), like the real ones."""
    for part in ("model/shard_0.bin", "model/shard_1.bin", "optim/state.bin", "rng.json"):
        os.makedirs(os.path.join(folder, os.path.dirname(part)), exist_ok=True)
        with open(os.path.join(folder, part), "wb") as f:
            f.write(os.urandom(4096))


def save(root: str, step: int, cursor: int | None = None) -> None:
    state = ckpt.CheckpointState(
        schema=1,
        step=step,
        weight_version=step,
        consumer_cursor=10 * step if cursor is None else cursor,
        run_options={},
    )
    ckpt.save_checkpoint(root, state, write_trainer_state)


def saved(root: str, steps) -> str:
    for step in steps:
        save(root, step)
    return root


def hidden(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(".iter_"))


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "extra, flag, message",
    [
        (("--save", "s", "--save-retain-last", "0"), "--save-retain-last", "must be >= 1"),
        (("--save-retain-last", "2"), "--save-retain-last", "needs --save"),
        (("--save", "s", "--save-retain-interval", "4"), "--save-retain-interval", "needs --save-interval"),
        (
            ("--save", "s", "--save-interval", "3", "--save-retain-interval", "4"),
            "--save-retain-interval",
            "must be a multiple of --save-interval (3)",
        ),
    ],
)
def test_bad_retention_flags_are_refused_naming_the_flag(config_dir, extra, flag, message):
    with pytest.raises(ConfigError) as error:
        parse_train_args(minimal_train_argv(config_dir, *extra))
    assert flag in str(error.value) and message in str(error.value)


def test_retention_is_off_by_default(config_dir):
    s = parse_train_args(minimal_train_argv(config_dir, "--save", "s", "--save-interval", "2"))
    assert (s.checkpoint.save_retain_last, s.checkpoint.save_retain_interval) == (None, None)
    assert not RetentionPolicy().enabled


# ----------------------------------------------------------------------------- what is kept
def test_keep_last_k_deletes_the_oldest_and_the_rest_still_loads(tmp_path):
    root = saved(str(tmp_path), range(1, 7))
    pruning = prune_checkpoints(root, RetentionPolicy(keep_last=2), committed_cursor=60)
    assert pruning.deleted == [1, 2, 3, 4]
    assert ckpt.complete_steps(root) == [5, 6] and hidden(root) == []
    assert ckpt.load_state(root)[1].step == 6 and ckpt.load_state(root, 5)[1].step == 5
    with pytest.raises(
        ckpt.CheckpointError, match=r"step 2 has no complete checkpoint .*complete checkpoints there: 5, 6"
    ):
        ckpt.load_state(root, 2)


def test_the_retain_interval_keeps_its_multiples_and_the_latest(tmp_path):
    root = saved(str(tmp_path), range(2, 16, 2))  # 2 .. 14
    prune_checkpoints(root, RetentionPolicy(retain_interval=4), committed_cursor=None)
    assert ckpt.complete_steps(root) == [4, 8, 12, 14]  # Megatron-LM's rule: the multiples, and the last one
    prune_checkpoints(root, RetentionPolicy(keep_last=2, retain_interval=8), committed_cursor=None)
    assert ckpt.complete_steps(root) == [8, 12, 14]


def test_an_abandoned_lineage_above_the_latest_is_left_alone(tmp_path):
    """After --load --ckpt-step 3, the resumed run saved step 3 again: 4-6 belong to the abandoned lineage."""
    root = saved(str(tmp_path), [1, 2, 3, 4, 5, 6])
    save(root, 3)
    assert ckpt.latest_step(root) == 3
    assert prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=30).deleted == [1, 2]
    assert ckpt.complete_steps(root) == [3, 4, 5, 6]


def test_nothing_is_deleted_unless_the_latest_is_complete(tmp_path):
    root = saved(str(tmp_path), [1, 2, 3])
    with open(os.path.join(root, ckpt.LATEST), "w") as f:
        f.write("4")  # names a step that has no complete folder (copied in by hand, say)
    assert prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=None).deleted == []
    assert ckpt.complete_steps(root) == [1, 2, 3]


def test_the_checkpoint_of_the_committed_cursor_is_kept_for_online_gc(tmp_path):
    """Online GC reclaims the groups before the queue's committed cursor: the checkpoint at that cursor is the
    oldest a resume can go back to. When the commit lags behind the latest checkpoint (a crash between the two
    writes), that one is kept too, whatever K says; once the commit catches up it goes."""
    root = saved(str(tmp_path), [2, 4, 6, 8])
    assert prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=60).deleted == [2, 4]
    assert ckpt.complete_steps(root) == [6, 8]
    assert prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=80).deleted == [6]
    # a cursor between two checkpoints protects the newest one at or before it
    assert doomed_steps({2: 20, 4: 40, 6: 60}, 6, RetentionPolicy(keep_last=1), committed_cursor=55) == [2]


# ----------------------------------------------------------------------------- never while writing
HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(os.path.join(sys.argv[1], ".checkpoint.lock"), os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_nothing_is_deleted_while_a_checkpoint_write_holds_the_lock(tmp_path):
    root = saved(str(tmp_path), [1, 2, 3])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, root], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        pruning = prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=30)
        assert pruning.deleted == [] and "checkpoint write holds" in pruning.skipped
        assert ckpt.complete_steps(root) == [1, 2, 3]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the kernel released the dead holder's lock: the next pruning goes on
    assert prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=30).deleted == [1, 2]


def test_a_write_killed_half_way_leaves_a_staging_folder_the_next_pruning_removes(tmp_path):
    root = saved(str(tmp_path), [1, 2])
    staging = os.path.join(root, ".iter_0000003.tmp-deadbeef")
    write_trainer_state(staging)  # what a SIGKILL inside save_checkpoint leaves (no state file, hidden name)
    assert ckpt.complete_steps(root) == [1, 2] and ckpt.load_state(root)[1].step == 2
    pruning = prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=20)
    assert (pruning.deleted, pruning.leftovers_removed) == ([1], 1) and hidden(root) == []


# ----------------------------------------------------------------------------- a SIGKILL mid-deletion
PRUNE = (
    "import sys; from vime.recovery.retention import RetentionPolicy, prune_checkpoints; "
    "prune_checkpoints(sys.argv[1], RetentionPolicy(keep_last=1), committed_cursor=None)"
)


@pytest.mark.parametrize(
    "kill_at, gone, half_deleted",
    [
        (2, [], 1),  # the 2nd file of the oldest checkpoint
        (FILES_PER_CHECKPOINT + 1 + 3, [1], 2),  # the oldest removed entirely, the next one half-way
    ],
)
def test_a_deletion_sigkilled_half_way_leaves_load_and_ckpt_step_working(tmp_path, kill_at, gone, half_deleted):
    root = saved(str(tmp_path), [1, 2, 3, 4])
    env = dict(os.environ, VIME_FAULTS=f"checkpoint.mid_delete@{kill_at}")
    env.pop("VIME_FAULT_STATE", None)
    result = subprocess.run([sys.executable, "-c", PRUNE, root], cwd=REPO, env=env, timeout=120, capture_output=True)
    assert result.returncode == -9, result.stderr  # SIGKILLed inside the deletion, nothing cleaned up after it
    # the half-deleted checkpoint is hidden: not a complete checkpoint, not iter_<step>, never loaded
    assert not os.path.exists(ckpt.iteration_dir(root, half_deleted))
    leftovers = hidden(root)
    assert len(leftovers) == 1 and leftovers[0].startswith(f".iter_{half_deleted:07d}.deleting-")
    left = sum(len(files) for _, _, files in os.walk(os.path.join(root, leftovers[0])))
    assert 0 < left < FILES_PER_CHECKPOINT + 1
    survivors = [step for step in [1, 2, 3, 4] if step not in gone and step != half_deleted]
    assert ckpt.complete_steps(root) == survivors
    # --load resumes the latest; --ckpt-step of a surviving step works, of the half-deleted one says so
    assert ckpt.load_state(root)[1].step == 4
    assert ckpt.load_state(root, survivors[0])[1].step == survivors[0]
    with pytest.raises(ckpt.CheckpointError, match=f"step {half_deleted} has no complete checkpoint"):
        ckpt.load_state(root, half_deleted)
    # the next pruning (the next save of the resumed run) finishes the job
    pruning = prune_checkpoints(root, RetentionPolicy(keep_last=1), committed_cursor=None)
    assert pruning.leftovers_removed == 1
    assert ckpt.complete_steps(root) == [4] and hidden(root) == []
