"""Benchmark: what a rollout worker's lease loop costs while the staleness bound admits nothing.

    .venv/bin/python bench/rollout/idle_lease.py            # 3 rounds of 10 s per loop (~1 min)
    .venv/bin/python bench/rollout/idle_lease.py --smoke    # seconds: 1 round of 1 s per loop

In an asynchronous run the rollout workers run ahead of the trainer by at most --max-staleness steps; at the bound,
while the trainer trains, a worker with free group slots gets nothing from the controller. It used to ask again
every 20 ms (``Controller.lease`` and a 20 ms sleep): two Ray calls' overhead each time, taken from the engine and
the trainer that share the machine. Now it calls ``Controller.lease_or_wait`` (workers/rollout_worker.py), which
waits in the controller until a call may have admitted something, or 0.5 s.

Both loops run here against the real ``Controller`` as a Ray actor (Ray's options of the run, a straw queue) held at
its bound (2 groups a rollout, --max-staleness 0, both leased), alternating, each for ``--seconds``; the CPU time of
the loop's process and of the controller's is read over each. Printed: calls made and CPU per wall second for each,
and the ratio after / before. The loop of before is rebuilt here as the baseline (it is not vime's code anymore).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

POLL_SECONDS = 0.02  # the worker's sleep between two lease calls, before lease_or_wait


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def polling_loop(controller, seconds: float) -> int:
    """The worker's loop before: lease, and on nothing a 20 ms sleep."""
    end, calls = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        leased = await controller.lease.remote("bench-worker", 8)
        calls += 1
        if not leased:
            await asyncio.sleep(POLL_SECONDS)
    return calls


async def waiting_loop(controller, seconds: float, wait_seconds: float) -> int:
    """The worker's loop now: lease_or_wait, waiting as long as the worker does."""
    end, calls = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        await controller.lease_or_wait.remote("bench-worker", 8, wait_seconds)
        calls += 1
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="wall seconds of each loop in a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds: 1 round of 1 s per loop")
    options = parser.parse_args(argv)
    if options.smoke:
        options.seconds, options.rounds = 1.0, 1
    if options.seconds <= 0 or options.rounds < 1:
        parser.error("--seconds must be > 0 and --rounds >= 1")

    import psutil
    import ray

    from tests.controller_spec import controller_spec, write_prompts
    from vime.workers.controller import Controller
    from vime.workers.rollout_worker import LEASE_WAIT_SECONDS

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        folder = Path(tempfile.mkdtemp(prefix="vime-bench-idle-lease-"))
        spec = controller_spec(folder, write_prompts(folder, 64), max_staleness=0)
        # The run's options (workers/run_processes.py), so that Ray runs it as it runs the run's controller.
        controller = ray.remote(num_cpus=0, max_restarts=10, max_task_retries=-1)(Controller).remote(spec)
        leased = ray.get(controller.lease.remote("bench-worker", 10))
        if len(leased) != 2 or ray.get(controller.lease.remote("bench-worker", 10)):
            raise SystemExit("the controller did not reach its staleness bound with 2 groups leased")
        process = psutil.Process(ray.get(controller.__ray_call__.remote(lambda _self: os.getpid())))

        def controller_cpu() -> float:
            times = process.cpu_times()
            return times.user + times.system

        results: dict[str, list[tuple[int, float, float, float]]] = {"before": [], "after": []}
        for _ in range(options.rounds):
            loops = (
                ("before", polling_loop(controller, options.seconds)),
                ("after", waiting_loop(controller, options.seconds, LEASE_WAIT_SECONDS)),
            )
            for name, loop in loops:
                worker0, controller0, start = own_cpu(), controller_cpu(), time.monotonic()
                calls = asyncio.run(loop)
                wall = time.monotonic() - start
                results[name].append((calls, wall, own_cpu() - worker0, controller_cpu() - controller0))
        ray.get(controller.shutdown.remote())
    finally:
        ray.shutdown()

    print("\n== a rollout worker's lease loop at the staleness bound (real controller actor, straw queue)")
    cores = {}
    for name, label in (("before", "lease every 20 ms (before)"), ("after", "lease_or_wait (after)")):
        rows = results[name]
        cores[name] = statistics.median((worker + ctrl) / wall for _, wall, worker, ctrl in rows)
        calls = statistics.median(calls / wall for calls, wall, _, _ in rows)
        worker = statistics.median(worker / wall for _, wall, worker, _ in rows)
        ctrl = statistics.median(ctrl / wall for _, wall, _, ctrl in rows)
        print(
            f"  {label:28s} {calls:6.1f} calls/s; CPU per wall second: worker {worker:.3f}, controller {ctrl:.3f}, "
            f"together {cores[name]:.3f} of a core"
        )
    print(f"  ratio after / before (CPU, median of {options.rounds} round(s)) = {cores['after'] / cores['before']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
