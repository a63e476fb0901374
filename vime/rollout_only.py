"""``--debug-rollout-only``: rollouts are generated and stored, nothing is trained (the reference's flag).

The rollout workers lease, generate, score, publish and get their groups accepted exactly as in a
training run. The driver's loop takes each step's ``--rollout-batch-size`` accepted groups by reference,
as a training step would, and moves on without training them:

- the engines keep the initial weights (version 0): no weight is published, no engine is paused;
- the trainer's process starts (as in any run) but never trains; no checkpoint or final model is written;
- the queue's consumer cursor is not committed: the groups stay in the queue (``vime queue inspect``);
- the controller is told that nothing was trained (TrainingRun.trained is 0), so admission keeps the
  rollout at most ``--max-staleness`` + 1 steps of groups ahead of the driver, as in training.

Each step writes a ``rollout`` record to metrics.jsonl: ``step``, ``groups``, ``samples``,
``response_tokens`` (accepted since the step before), ``step_seconds``, ``samples_per_s``, ``queue_depth``, and
what --custom-rollout-log-function-path answers (called by the trainer's rank 0 on the step's samples, as in
training, with ``rollout_time`` the step's seconds).
bench/rollout/run.py measures vime's rollout path alone with it.
"""

from __future__ import annotations

import json
import os
import time

from vime.runtime import interrupts

# A rollout record's metrics of the step's data, which the trackers leave out when
# --custom-rollout-log-function-path says it logged the data itself (vime/runtime/log_hooks.py).
DATA_METRICS = ("groups", "samples", "response_tokens", "groups_regenerated")


def rollout_only(run, start_step: int, version: int) -> int:
    """The loop of a ``--debug-rollout-only`` run (``run``: vime.train.TrainingRun, its processes started and
    its rollout workers generating); stops the rollout workers and writes summary.json. Returns the exit status."""
    import ray

    s = run.s
    batch, n = s.rollout.rollout_batch_size, s.rollout.n_samples_per_prompt
    controller = run.processes.controller
    stats = ray.get(controller.stats.remote())
    last_time, last_tokens = time.monotonic(), stats.accepted_response_tokens
    run.log.say(
        f"--debug-rollout-only: {s.train.num_rollout - start_step} rollout(s) of {batch} group(s) x {n} "
        "sample(s), generated and stored, none trained"
    )
    step = start_step
    while step < s.train.num_rollout:
        interrupts.raise_if_interrupted()
        try:
            taken = run.wait_for_groups(batch, step + 1)
        except StopIteration:
            run.log.say(f"--num-epoch {s.data.num_epoch} exhausted the prompts after {step} rollout(s)")
            break
        run.consume(taken)
        ray.get(controller.sync.remote(version, run.cursor, run.trained, run.lineage))  # admission moves on
        step = run.step = step + 1
        stats = ray.get(controller.stats.remote())
        now = time.monotonic()
        seconds = now - last_time
        samples = len(taken.groups) * n
        record = {
            "kind": "rollout",
            "step": step,
            "weight_version": version,
            "groups": len(taken.groups),
            "samples": samples,
            "response_tokens": stats.accepted_response_tokens - last_tokens,
            "step_seconds": seconds,
            "samples_per_s": samples / max(seconds, 1e-9),
            "queue_depth": stats.queue_depth,
            "groups_regenerated": len(taken.skipped),
        }
        last_time, last_tokens = now, stats.accepted_response_tokens
        if s.hooks.custom_rollout_log_function_path:  # the trainer's rank 0 reads the samples and calls it
            record.update(run.processes.trainer.log_rollout(step - 1, taken.groups, seconds, list(DATA_METRICS)))
        run.log.write(record)
        run.log.say(
            f"rollout {step:>4}/{s.train.num_rollout} | {samples} samples in {seconds:.2f}s "
            f"({record['samples_per_s']:.1f}/s) | queue {stats.queue_depth}"
        )
    run.processes.stop_rollout_workers()
    run.log.say(f"--debug-rollout-only: {step - start_step} rollout(s) generated, nothing trained")
    with open(os.path.join(run.run_dir, "summary.json"), "w") as f:
        json.dump({"weight_version": version, "rollout_only": True, "rollouts": step - start_step}, f, indent=1)
    return 0
