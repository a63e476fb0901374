"""Joint model + queue checkpoints (DESIGN §5).

``iter_{step:07d}/`` holds the trainer state (model, optimizer, RNG) written by the trainer and
``vime_state.json``: the queue state that belongs to the same step (consumer cursor, dataset
cursor, weight version) and the run-defining options. The folder is written under a temporary
name and renamed when complete; ``latest_checkpointed_iteration.txt`` is then replaced atomically.
A checkpoint is complete or invisible, never half-written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from vime.errors import UserError
from vime.recovery.faults import fault_point
from vime.recovery.lineage import Lineage
from vime.runtime.durable import fsync_path

LATEST = "latest_checkpointed_iteration.txt"
STATE = "vime_state.json"


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
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def save_checkpoint(root: str, state: CheckpointState, write_trainer_state: Callable[[str], None]) -> str:
    os.makedirs(root, exist_ok=True)
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
        raise CheckpointError(f"--load {root}: step {step} has no complete checkpoint ({folder})") from None


def check_run_options(saved: dict[str, Any], current: dict[str, Any]) -> None:
    for name, value in current.items():
        if name in saved and saved[name] != value:
            raise CheckpointError(
                f"--{name.replace('_', '-')}: the checkpoint was made with {saved[name]!r}, "
                f"this run has {value!r}; a resumed run cannot change it"
            )
