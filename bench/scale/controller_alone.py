"""The controller's own cost per call, alone: no Ray, no router, no engines, one process (bench/scale).

    .venv/bin/python bench/scale/controller_alone.py [--groups 400] [--batch 64] [--lease 1]

bench/scale/run.py measures the control plane as a whole, where every process competes for the machine's
cores; this measures what one group costs the Controller (workers/controller.py) on its straw queue when
nothing else runs: lease ``--lease`` prompts at a time, publish each group of 8 samples (64-token responses)
with the rollout worker's StrawTransport, have it accepted (Controller.complete), and take + commit every
``--batch`` groups as the driver does. Printed: mean, p50 and p99 milliseconds of each call, and the
controller's time per group (lease share + complete + take/commit share), whose inverse is the most groups
per second one controller thread can accept on this disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def group_samples(group_index: int):
    from vime.sample import Sample, Status

    return [
        Sample(
            group_index=group_index,
            index=i,
            prompt_index=0,
            tokens=[1] * 80,
            response_length=64,
            loss_mask=[1] * 64,
            reward=0.0,
            status=Status.COMPLETED,
            rollout_log_probs=[-0.5] * 64,
            weight_versions=[0] * 64,
        )
        for i in range(8)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64, help="--rollout-batch-size: groups a take + commit")
    parser.add_argument("--lease", type=int, default=1, help="prompts leased a call")
    options = parser.parse_args()

    from vime.data.source import DataKeys
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport
    from vime.workers.controller import Controller, ControllerSpec

    root = tempfile.mkdtemp(prefix="vime-bench-controller-")
    try:
        store = StoreOptions(os.path.join(root, "straw"), "bench", 64.0)
        controller = Controller(
            ControllerSpec(
                transport="straw",
                store=store,
                lease_seconds=120,
                prompt_data=os.path.join(REPO, "examples", "digit_shift", "train.jsonl"),
                keys=DataKeys("prompt", "label"),
                seed=0,
                shuffle=True,
                num_epoch=None,
                groups_per_rollout=options.batch,
                max_staleness=1,
            )
        )
        transport = StrawTransport(store)
        timings: dict[str, list[float]] = {"lease": [], "publish (worker)": [], "complete": [], "take+commit": []}
        cursor = step = done = 0
        while done < options.groups:
            started = time.perf_counter()
            items = controller.lease("bench", options.lease)
            timings["lease"].append(time.perf_counter() - started)
            for item in items:
                lease = item.assignment.lease
                submission = f"{lease.task_id}-{lease.attempt_id}"
                started = time.perf_counter()
                ref = transport.publish(
                    group_samples(item.assignment.task.group_index),
                    task_id=lease.task_id,
                    attempt_id=lease.attempt_id,
                    submission_id=submission,
                )
                timings["publish (worker)"].append(time.perf_counter() - started)
                started = time.perf_counter()
                controller.complete(lease, submission, ref, 8, 512, 0)
                timings["complete"].append(time.perf_counter() - started)
                done += 1
            started = time.perf_counter()
            taken = controller.take_groups(cursor, options.batch, 0, 0)
            if taken.groups:
                step, cursor = step + 1, taken.next_cursor
                controller.commit(step, cursor, [cursor], [])
                timings["take+commit"].append(time.perf_counter() - started)
        controller.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"== bench/scale controller alone: {options.groups} groups, {options.lease} leased a call, "
        f"batch {options.batch}"
    )
    mean = {}
    for name, values in timings.items():
        ordered = sorted(values)
        mean[name] = sum(ordered) / len(ordered)
        print(
            f"  {name:17s} n={len(ordered):4d}  mean {mean[name] * 1e3:6.2f} ms  p50 "
            f"{ordered[len(ordered) // 2] * 1e3:6.2f}  p99 {ordered[int(len(ordered) * 0.99)] * 1e3:6.2f}"
        )
    per_group = mean["lease"] / options.lease + mean["complete"] + mean["take+commit"] / options.batch
    print(f"  controller per group: {per_group * 1e3:.2f} ms -> at most {1 / per_group:.0f} groups/s on one thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
