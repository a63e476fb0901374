"""Debug replay (DESIGN §7): record every trained batch; train on the recordings without engines.

Recording (``--save-debug-rollout-data PATH``): after each step ``vime train`` calls
:func:`save_trained_batch`, which asks the trainer for the very samples it trained (the same
``read_groups`` the step used, from the same references, before the queue cursor moves) and the
settings it trained them with, and writes one immutable archive per step
(``recovery/debug_archive.py``).

Replay (``--load-debug-rollout-data PATH``): :func:`replay` builds the run's trainer worker in
this process — no Ray, engines, router, rollout workers or queue — and feeds it the recorded
batches with their recorded policy versions, from rollout 0 (or from the ``--load`` checkpoint)
for ``--num-rollout`` steps or as many archives as exist. Each step's metrics go to
``<run-dir>/metrics.jsonl`` as in training, and ``<run-dir>/replay.json`` says, per step, whether
they equal the recorded ones bit for bit. See docs/replay.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from vime.config.base import ConfigError
from vime.recovery import checkpoint as ckpt
from vime.recovery.debug_archive import (
    LOAD_FLAG,
    SAVE_FLAG,
    ArchiveError,
    archive_path,
    build_archive,
    metric_differences,
    read_archive,
    spec_as_dict,
    write_archive,
)

# Trainer settings that may differ without changing the numbers (placement only).
_PLACEMENT = ("cpu_affinity",)
_ANNOUNCED: set[str] = set()


# ============================================================================== recording
RANKS_KEY = "trainer_ranks"
# One rank replaying what several trained adds the same numbers in another order (docs/parallelism.md).
SEVERAL_RANKS_REL_TOL = 1e-5


def _trained_batch(worker, groups) -> tuple[list[list], dict[str, Any]]:
    """Runs inside the trainer actor (rank 0): the step's samples per group (read exactly as
    ``train_rollout`` reads them) and the trainer's settings, with its number of ranks."""
    settings = {**spec_as_dict(worker.spec.backend), RANKS_KEY: worker.world_size}
    return [worker.read_groups([group]) for group in groups], settings


def save_trained_batch(run, rollout_id: int, groups: list, policy_version: int, metrics: dict[str, float]) -> None:
    """Archive the batch ``run.processes.trainer`` just trained for ``rollout_id`` (--save-debug-rollout-data).

    ``groups`` are the step's accepted groups (by reference), ``policy_version`` the weight version
    it trained, ``metrics`` what ``train_rollout`` returned. Raises ArchiveExists (a ConfigError
    naming the flag and the file) when the step's archive exists with another batch.
    """
    import ray

    template = run.s.debug.save_debug_rollout_data
    path = archive_path(template, rollout_id)
    # __ray_call__ runs _trained_batch on the trainer actor itself: the step's groups are read there
    # as train_rollout read them, and the spec it trained with is the one recorded.
    members, trainer = ray.get(run.processes.trainer.leader.__ray_call__.remote(_trained_batch, groups))
    archive = build_archive(
        rollout_id=rollout_id,
        policy_version=policy_version,
        metrics=metrics,
        trainer=trainer,
        groups=[(g.position, g.task_id, m) for g, m in zip(groups, members)],
        argv=sys.argv,
    )
    if template not in _ANNOUNCED:
        _ANNOUNCED.add(template)
        run.log.say(f"recording every trained batch: {os.path.abspath(template)}")
    if write_archive(path, archive) == "kept":
        differ = metric_differences(read_archive(path, SAVE_FLAG).metrics, metrics)
        note = f"; its recorded metrics differ from this training in: {', '.join(differ)}" if differ else ""
        run.log.say(
            f"step {rollout_id + 1} was trained again (resumed run) on the same batch: kept its archive {path}{note}"
        )


# ============================================================================== replay
@dataclasses.dataclass(frozen=True)
class ReplayGroup:
    position: int
    task_id: str
    samples: list


def _replay_trainer_class():
    from vime.workers.trainer_worker import TrainerWorker

    class ReplayTrainer(TrainerWorker):
        """The run's trainer worker, reading each batch from its archive instead of the queue."""

        def read_groups(self, groups: list[ReplayGroup]) -> list:
            return [sample for group in groups for sample in group.samples]

    return ReplayTrainer


def trainer_spec(s, threads: int | None):
    """The trainer worker spec ``vime train`` builds from these settings (no queue, no placement)."""
    from vime.queue.rollout_queue import StoreOptions
    from vime.workers.trainer_worker import TrainerWorkerSpec

    # "object-store" opens nothing: the replay never touches the run's queue.
    return TrainerWorkerSpec.from_settings(
        s, transport="object-store", store=StoreOptions(s.rollout_data_dir), threads=threads, cpu_affinity=None
    )


def spec_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name: recorded -> now' for every trainer setting that differs from the recording."""
    names = sorted(set(recorded) | set(current))
    return [
        f"{name}: {recorded.get(name)!r} -> {current.get(name)!r}"
        for name in names
        if name not in _PLACEMENT and recorded.get(name) != current.get(name)
    ]


def replay(s, log) -> int:
    """Train on the recorded batches (``vime train ... --load-debug-rollout-data PATH``)."""
    try:
        return _replay(s, log)
    finally:
        log.close()


def _replay(s, log) -> int:
    template = s.debug.load_debug_rollout_data
    if os.path.getsize(log.path) > 0:
        raise ConfigError(
            "--run-dir",
            f"{s.run_dir} already holds a run's metrics.jsonl; give the replay a "
            "--run-dir of its own (a replay never writes into a recorded run)",
        )
    start, checkpoint = 0, None
    if s.checkpoint.load and (ckpt.latest_step(s.checkpoint.load) is not None or s.checkpoint.ckpt_step is not None):
        checkpoint, state = ckpt.load_state(s.checkpoint.load, s.checkpoint.ckpt_step)
        start = state.step
    if s.checkpoint.save:
        log.say("--save is ignored by a replay: it writes no checkpoint")
    first = archive_path(template, start)
    if not os.path.exists(first):
        where = f" (--load {s.checkpoint.load} starts at step {start + 1})" if checkpoint else ""
        raise ArchiveError(LOAD_FLAG, f"no archive for rollout {start}{where}: {first} does not exist")
    archive = read_archive(first)
    recorded_threads = archive.trainer.get("threads")
    threads = s.train.train_threads or recorded_threads or 1
    spec = trainer_spec(s, threads)
    recorded = {k: v for k, v in archive.trainer.items() if k != RANKS_KEY}
    for difference in spec_differences(recorded, spec_as_dict(spec.backend)):
        log.say(f"warning: the trainer differs from the recording ({difference}): expect other numbers")
    ranks = int(archive.trainer.get(RANKS_KEY, 1))
    rel_tol = SEVERAL_RANKS_REL_TOL if ranks > 1 else 0.0
    if ranks > 1:
        log.say(
            f"the recording was trained on {ranks} trainer ranks: one rank adds the same numbers in another "
            f"order, so metrics are compared within {rel_tol:g} relative instead of bit for bit"
        )
    log.say(
        f"replaying the batches recorded at {template} from rollout {start}: no engine, router, rollout "
        f"worker or queue; torch backend on {threads} thread(s)"
    )
    trainer = _replay_trainer_class()(spec)
    results: list[dict[str, Any]] = []
    try:
        if checkpoint:  # --no-load-optim as the recorded run resumed
            trainer.load_checkpoint(checkpoint, optimizer=not s.checkpoint.no_load_optim)
            log.say(f"trainer state from {checkpoint} (step {start})")
        for rollout_id in range(start, s.train.num_rollout):
            path = archive_path(template, rollout_id)
            if rollout_id != start:
                if not os.path.exists(path):
                    log.say(f"no archive for rollout {rollout_id} ({path}): stopping after {len(results)} step(s)")
                    break
                archive = read_archive(path)
            if archive.rollout_id != rollout_id:
                raise ArchiveError(LOAD_FLAG, f"{path} holds rollout {archive.rollout_id}, not {rollout_id}")
            groups = [
                ReplayGroup(g.position, g.task_id, members) for g, members in zip(archive.groups, archive.grouped())
            ]
            metrics = trainer.train_rollout(rollout_id, groups, archive.policy_version)
            differ = metric_differences(archive.metrics, metrics, rel_tol)
            step, version = rollout_id + 1, archive.policy_version + 1
            log.write(
                {
                    "kind": "train",
                    "step": step,
                    "weight_version": version,
                    **metrics,
                    "replay": True,
                    "replay_matches": not differ,
                }
            )
            results.append(
                {
                    "step": step,
                    "rollout_id": rollout_id,
                    "policy_version": archive.policy_version,
                    "archive": path,
                    "matches": not differ,
                    "differing": differ,
                    "recorded": {k: archive.metrics.get(k) for k in ("loss", "grad_norm")},
                    "replayed": {k: metrics.get(k) for k in ("loss", "grad_norm")},
                }
            )
            verdict = "= recorded" if not differ else "DIFFERS in " + ", ".join(differ)
            loss, grad_norm = metrics.get("loss", float("nan")), metrics.get("grad_norm", float("nan"))
            print(
                f"replay {step:>4}/{s.train.num_rollout} | v{version} | loss {loss:.6g} | "
                f"grad_norm {grad_norm:.6g} | {verdict}",
                file=log.stream,
                flush=True,
            )
    finally:
        trainer.shutdown()
    mismatched = [r["step"] for r in results if not r["matches"]]
    with open(os.path.join(s.run_dir, "replay.json"), "w") as f:
        json.dump({"archives": template, "steps": results, "all_match": not mismatched}, f, indent=1)
    if mismatched:
        log.say(
            f"replayed {len(results)} step(s); {len(mismatched)} differ from the recording (steps "
            f"{', '.join(map(str, mismatched[:10]))}); details in {os.path.join(s.run_dir, 'replay.json')}"
        )
    else:
        log.say(
            f"replayed {len(results)} step(s): every metric (loss, grad_norm, ...) equals the recording "
            + ("bit for bit" if not rel_tol else f"within {rel_tol:g} relative")
        )
    return 0
