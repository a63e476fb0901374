"""Joint model + queue checkpoints (DESIGN §5).

``iter_{step:07d}/`` holds the trainer state (model, optimizer, RNG) written by the trainer and
``vime_state.json``: the queue state that belongs to the same step (consumer cursor, dataset
cursor, weight version) and the run-defining options. The folder is written under a temporary
name and renamed when complete; ``latest_checkpointed_iteration.txt`` is then replaced atomically.
A checkpoint is complete or invisible, never half-written. A write holds ``.checkpoint.lock`` (an
flock) in the folder, so that retention (recovery/retention.py) never deletes while one is in progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from vime.errors import UserError
from vime.recovery.faults import fault_point
from vime.recovery.lineage import Lineage
from vime.runtime.durable import fsync_path

LATEST = "latest_checkpointed_iteration.txt"
STATE = "vime_state.json"
LOCK = ".checkpoint.lock"
LOCK_TIMEOUT_S = 120.0  # a write waits this long for a deletion in another process to finish


class CheckpointError(UserError, ValueError):
    """A --load that cannot be resumed from: no checkpoint there, or one made with other run options."""


class CheckpointState(msgspec.Struct, frozen=True):
    schema: int
    step: int  # rollouts trained
    weight_version: int
    consumer_cursor: int  # accepted groups trained (queue positions < cursor)
    run_options: dict[str, Any]  # options a resumed run must not change
    step_cursors: list[int] = []  # consumer cursor after each step of this lineage
    skipped: list[int] = []  # positions before the cursor not trained (too stale; regenerated)
    # restores in place of this lineage (recovery/lineage.py): which versions are lost, which step a version is
    lineage: Lineage = msgspec.field(default_factory=Lineage)


def iteration_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full volume: the old file stays, no torn one beside it
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(path))


@contextlib.contextmanager
def checkpoint_lock(root: str, *, wait_s: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold the folder's checkpoint lock (an flock: released by the kernel when its holder dies, even by a
    SIGKILL). Yields whether it was taken; ``wait_s`` 0: at once or not at all."""
    fd = os.open(os.path.join(root, LOCK), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def save_checkpoint(root: str, state: CheckpointState, write_trainer_state: Callable[[str], None]) -> str:
    os.makedirs(root, exist_ok=True)
    with checkpoint_lock(root) as locked:
        if not locked:
            raise CheckpointError(
                f"--save {root}: {LOCK} is held by another process for over {LOCK_TIMEOUT_S:g}s "
                "(is another run writing or deleting checkpoints there?)"
            )
        return _write_checkpoint(root, state, write_trainer_state)


def _write_checkpoint(root: str, state: CheckpointState, write_trainer_state: Callable[[str], None]) -> str:
    final = iteration_dir(root, state.step)
    staging = os.path.join(root, f".iter_{state.step:07d}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_trainer_state(staging)
        fault_point("checkpoint.mid_write", scope="group")  # the whole job dies while writing
        _atomic_write(os.path.join(staging, STATE), msgspec.json.encode(state))
        if os.path.exists(final):
            shutil.rmtree(final)  # a re-save of the same step after a crash replaces the old one
        os.rename(staging, final)
        fsync_path(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _atomic_write(os.path.join(root, LATEST), str(state.step).encode())
    return final


def latest_step(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def load_state(root: str, step: int | None = None) -> tuple[str, CheckpointState]:
    step = latest_step(root) if step is None else step
    if step is None:
        raise CheckpointError(f"--load {root}: no {LATEST} (nothing was saved there)")
    folder = iteration_dir(root, step)
    try:
        with open(os.path.join(folder, STATE), "rb") as f:
            return folder, msgspec.json.decode(f.read(), type=CheckpointState)
    except FileNotFoundError:
        steps = complete_steps(root)
        there = f"complete checkpoints there: {', '.join(map(str, steps))}" if steps else "no complete checkpoint there"
        raise CheckpointError(f"--load {root}: step {step} has no complete checkpoint ({folder}; {there})") from None


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints in ``root`` (an ``iter_NNNNNNN/`` folder with its state file), oldest
    first. A folder being written or deleted has another (hidden) name, so it is never among them."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.isfile(os.path.join(root, name, STATE)):
            steps.append(int(name[5:]))
    return sorted(steps)


def read_state(root: str, step: int) -> CheckpointState:
    with open(os.path.join(iteration_dir(root, step), STATE), "rb") as f:
        return msgspec.json.decode(f.read(), type=CheckpointState)


def check_run_options(saved: dict[str, Any], current: dict[str, Any]) -> None:
    for name, value in current.items():
        if name in saved and saved[name] != value:
            raise CheckpointError(
                f"--{name.replace('_', '-')}: the checkpoint was made with {saved[name]!r}, "
                f"this run has {value!r}; a resumed run cannot change it"
            )
