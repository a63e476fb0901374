"""Benchmark: the control plane at scale, by simulation: 16, 64 and 256 stand-in engines (issue 20, point 5).

    .venv/bin/python bench/scale/run.py [--engines 16 64 256] [--seconds 20] [--warmup-seconds 8] [--profile-controller]
    .venv/bin/python bench/scale/run.py --smoke

What runs is vime's real control plane, without the trainer and without real engines:

- the real Controller actor (workers/controller.py) on a real straw queue (queue/, journal on local disk), as
  `vime train` creates it (same ControllerSpec fields, the demo's dataset, --max-staleness 1);
- a real vllm-router with vime's router defaults (vime.config.router.DEFAULTS, round_robin), every stand-in
  engine registered with /add_worker as vime registers its engines;
- real rollout workers (workers/rollout_worker.py) as Ray actors, one per ``--engines-per-worker`` engines
  (a worker per rollout node of 8 GPUs would be 8; 64 keeps the 256-engine point at 4 worker processes on
  this 2-core machine), each keeping ``--in-flight-per-engine`` x engines / n samples' groups in flight,
  rendering prompts, generating through the router, scoring with the demo's reward, publishing every
  group's samples to straw and having the controller accept it;
- in this process, a consumer that takes the accepted groups as `vime train --debug-rollout-only` does
  (Controller.take_groups with the driver's cursor, then Controller.commit of every step, which journals the
  consumer cursor), so what is measured is the control plane's rate, not a trainer's.

The engines are STAND-INS (bench/scale/standin_engine.py): one process serving every engine on its own
port, answering vime's /inference/v1/generate with ``--response-tokens`` token ids and log-probs after
``--latency-s`` + tokens / ``--tokens-per-s`` seconds. They are used only because real engines cannot run at
that count here. Their capacity is known: in-flight samples / request time; the report prints it as
"engine cap", and a rate well below it means the control plane, not the engines, is the limit.

Reported per point, over ``--seconds`` after ``--warmup-seconds``: accepted groups/s (Controller.complete calls
in the window; the consumer keeps taking them, so nothing piles up), p50/p99 of lease and accept latency
(time.perf_counter around ``controller.lease.remote`` and ``controller.complete.remote`` in each rollout
worker, Ray round trip included: what a worker waits),
the straw directory's growth per 10k accepted groups (journal files alone, and everything including the
samples' payload), the controller's RSS, the CPU share of each process (controller, router, stand-ins,
rollout workers, this driver; "whole machine" includes Ray's own and anything else running) over the window
and per accepted group, and how busy the controller actor's one thread was in calls: which names the
saturated component.

The goal (issue 20, point 5): at 256 stand-in engines, at least 10x the acceptance rate a 128-GPU fleet
produces for a 7B model at 8k-token responses, with p99 accept latency under 100 ms. The estimate:

    decode throughput of a 7B model (bf16, TP 1) on one H100 at a realistic RL batch (~256 sequences):
        ~2,500 - 5,000 tokens/s; take the generous end, 5,000 tokens/s per GPU
    fleet:        128 GPUs x 5,000 tokens/s              = 640,000 tokens/s
    responses:    640,000 / 8,192 tokens per response    = 78 responses/s
    groups:       78 / 8 samples per prompt (n = 8)      = 9.8 groups/s      (prefill ignored: generous)
    goal (10x):   >= 98 accepted groups/s, i.e. ~780 samples/s through router and workers; p99 accept < 100 ms

The stand-ins answer ``--response-tokens`` (default 64) tokens, not 8,192: the control plane's work per group
(a lease, an acceptance, a journal entry, a commit share) does not depend on the response length, while
8k-token payloads would measure this machine's JSON parsing and disk instead (that data plane is
bench/queue's). So the payload bytes per 10k groups here are a 64-token figure.

``--smoke`` runs 2 stand-in engines, 1 worker, a 2-second window after 1 s: it checks that the benchmark works, its
numbers mean nothing.

``--profile-controller`` prints the controller actor's cProfile over the window (where its thread's time goes).

Measured: docs/scale.md (the table, the first bottleneck found and what moved it, what would move the next).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

GOAL_GROUPS_PER_S = 98.0  # 10 x the 128-GPU / 7B / 8k-token estimate in the docstring
GOAL_P99_ACCEPT_MS = 100.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- in the workers
class TimedCall:
    """``controller.<method>.remote(...)`` awaited by a rollout worker, timed at the caller (Ray round trip and
    the actor's queue included): (wall time at the end, seconds) per call."""

    def __init__(self, method, timings: list):
        self.method, self.timings = method, timings

    def remote(self, *args, **kwargs):
        started = time.perf_counter()
        ref = self.method.remote(*args, **kwargs)
        return self._wait(ref, started)

    async def _wait(self, ref, started: float):
        result = await ref
        self.timings.append((time.time(), time.perf_counter() - started))
        return result


class TimedController:
    """The controller's handle as a rollout worker sees it, with lease and complete (the acceptance) timed."""

    def __init__(self, handle):
        self.handle = handle
        self.timings: dict[str, list] = {"lease": [], "complete": []}

    def __getattr__(self, name):
        method = getattr(self.handle, name)
        return TimedCall(method, self.timings[name]) if name in self.timings else method


def make_worker_class():
    """The rollout worker, with its controller calls timed (defined here so that Ray ships it by value)."""
    from vime.workers.rollout_worker import RolloutWorker

    class TimedRolloutWorker(RolloutWorker):
        def __init__(self, spec, controller):
            super().__init__(spec, TimedController(controller))

        def timings(self) -> dict[str, list]:
            # copies: the calls still in flight append to the lists while Ray serialises the answer
            return {kind: list(values) for kind, values in self.controller.timings.items()}

        def pid(self) -> int:
            return os.getpid()

    return TimedRolloutWorker


# ---------------------------------------------------------------------------------------------- in the controller
MEASURED_CONTROLLER_CALLS = ("lease", "complete", "heartbeat", "return_partial", "take_groups", "commit", "stats")


def _measured(method, name: str):
    def measured(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.bench_calls.append((name, time.time(), time.perf_counter() - started))

    measured.__name__ = name
    return measured


def make_controller_class():
    """The Controller, each call's time inside the actor recorded: (method, wall time at the end, seconds). Its
    sum over the window is how busy the actor's one thread was; caller's latency minus this is waiting."""
    from vime.workers.controller import Controller

    class MeasuredController(Controller):
        def __init__(self, spec):
            self.bench_calls: list[tuple[str, float, float]] = []
            super().__init__(spec)

        def calls(self) -> list[tuple[str, float, float]]:
            return list(self.bench_calls)

    for name in MEASURED_CONTROLLER_CALLS:
        setattr(MeasuredController, name, _measured(getattr(Controller, name), name))
    return MeasuredController


# ---------------------------------------------------------------------------------------------- measuring
def start_profile(controller) -> None:
    """--profile-controller: cProfile the controller actor's calls (they all run on one thread)."""
    import cProfile

    controller._bench_profile = cProfile.Profile()
    controller._bench_profile.enable()


def stop_profile(controller) -> str:
    import io
    import pstats

    controller._bench_profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(controller._bench_profile, stream=text)
    stats.sort_stats("tottime").print_stats(12)
    # where the queue's time goes, by the controller's and the queue's methods
    stats.sort_stats("cumulative").print_stats(r"controller.py|rollout_queue.py", 20)
    return text.getvalue()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its waited-for children so far (0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / CLOCK_TICKS  # utime stime cutime cstime


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def dir_bytes(path: str, *, journal_only: bool) -> int:
    """Bytes under the straw directory: everything, or only its journal (files under a 'journal' folder or
    named like one; straw's payload packs excluded)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if journal_only and "journal" not in os.path.relpath(full, path) and "wal" not in name:
                continue
            try:
                total += os.path.getsize(full)
            except OSError:
                pass
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclasses.dataclass
class Point:
    engines: int
    workers: int
    groups_in_flight: int
    seconds: float
    groups: int
    engine_cap_groups_per_s: float
    lease_ms: tuple[float, float]
    accept_ms: tuple[float, float]
    accept_inside_ms: tuple[float, float]  # Controller.complete's own time, in the actor
    controller_busy: float  # share of the window the controller actor's one thread spent in calls
    journal_bytes_per_10k: float
    store_bytes_per_10k: float
    controller_rss_mib: float
    cpu_share: dict[str, float]

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


# ---------------------------------------------------------------------------------------------- one point
def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive free ports."""
    import random

    from vime.runtime.ports import port_is_free

    for _ in range(200):
        first = random.randrange(20000, 60000 - count)
        if all(port_is_free("127.0.0.1", p) for p in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def start_standins(engines: int, options, log_path: str) -> tuple[subprocess.Popen, list[str]]:
    first = free_port_range(engines)
    log = open(log_path, "w")  # the child writes to it until stopped
    process = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "standin_engine.py"),
            "--engines",
            str(engines),
            "--first-port",
            str(first),
            "--tokens-per-s",
            str(options.tokens_per_s),
            "--latency-s",
            str(options.latency_s),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    line = process.stdout.readline()
    if not line.startswith("READY"):
        process.kill()
        raise SystemExit(f"the stand-in engines did not start (see {log_path})")
    return process, [f"http://127.0.0.1:{p}" for p in range(first, first + engines)]


def job_settings(model: str, run_dir: str, options, batch: int):
    from run_demo import demo_args

    from vime.config import parse_train_args

    args = demo_args(run_dir, model) + ["--debug-rollout-only"]
    for flag, value in (
        ("--rollout-batch-size", str(batch)),
        ("--n-samples-per-prompt", str(options.n)),
        ("--rollout-max-response-len", str(options.response_tokens)),
    ):
        args[args.index(flag) + 1] = value
    return parse_train_args(args)


def run_point(engines: int, options, model: str, work: str) -> Point:
    import ray

    from vime.config.router import DEFAULTS
    from vime.data.source import DataKeys
    from vime.engines.router import RouterClient, start_router
    from vime.queue.rollout_queue import StoreOptions
    from vime.workers.controller import ControllerSpec
    from vime.workers.rollout_worker import RolloutWorkerSpec

    out = os.path.join(work, f"engines-{engines}")
    os.makedirs(out)
    workers = max(1, -(-engines // options.engines_per_worker))
    groups_per_worker = max(1, round(engines * options.in_flight_per_engine / options.n / workers))
    in_flight_groups = workers * groups_per_worker
    # --rollout-batch-size: the admission bound (--max-staleness 1 admits 2 batches ahead) never binds
    s = job_settings(model, os.path.join(out, "run"), options, batch=in_flight_groups)
    token = f"bench-scale-{uuid.uuid4().hex[:8]}"
    standins, urls = start_standins(engines, options, os.path.join(out, "standins.log"))
    router = None
    actors = []
    try:
        router = start_router(log_path=os.path.join(out, "router.log"), run_token=token, router_args=dict(DEFAULTS))
        client = RouterClient(router.url)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client.add_worker, urls))
        data_dir = os.path.join(out, "straw")
        q = s.queue
        store = StoreOptions(data_dir, q.rollout_queue_run_id, q.rollout_queue_segment_mib, q.rollout_queue_online_gc)
        controller = ray.remote(num_cpus=0)(make_controller_class()).remote(
            ControllerSpec(
                transport="straw",
                store=store,
                lease_seconds=q.rollout_queue_lease_seconds,
                prompt_data=s.data.prompt_data,
                keys=DataKeys(s.data.input_key, s.data.label_key, s.data.metadata_key),
                seed=s.run.seed,
                shuffle=s.data.rollout_shuffle,
                num_epoch=None,
                groups_per_rollout=in_flight_groups,
                max_staleness=s.max_staleness,
            )
        )
        ray.get(controller.ready.remote())
        worker_class = ray.remote(num_cpus=0)(make_worker_class())
        for index in range(workers):
            spec = RolloutWorkerSpec.from_settings(s, index=index, router_url=router.url, store=store)
            spec = dataclasses.replace(spec, max_concurrent_groups=groups_per_worker)
            actors.append(worker_class.remote(spec, controller))
        ray.get([a.open_queue.remote() for a in actors])
        pids = {
            "controller": [ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))],
            "router": [router.process.pid],
            "stand-ins": [standins.pid],
            "workers": ray.get([a.pid.remote() for a in actors]),
            "driver": [os.getpid()],
        }
        runs = [a.run.remote() for a in actors]
        if options.profile_controller:
            ray.get(controller.__ray_call__.remote(start_profile))

        consumer = Consumer(controller, in_flight_groups)
        thread = threading.Thread(target=consumer.loop, daemon=True)
        thread.start()
        time.sleep(options.warmup_seconds)
        start = snapshot(consumer, data_dir, pids)
        time.sleep(options.seconds)
        end = snapshot(consumer, data_dir, pids)
        rss = rss_mib(pids["controller"][0])
        if options.profile_controller:
            print(ray.get(controller.__ray_call__.remote(stop_profile)), flush=True)
        consumer.stop = True
        thread.join(timeout=30)
        if consumer.error is not None:
            raise consumer.error
        ray.get([a.stop.remote() for a in actors])
        for stats in ray.get(runs, timeout=120):
            if stats.errors or stats.engine_errors:
                print(
                    f"  note: a worker had {stats.errors} group error(s), {stats.engine_errors} engine error(s): "
                    f"{stats.last_error or stats.last_engine_error}"
                )
        timings = ray.get([a.timings.remote() for a in actors])
        controller_calls = ray.get(controller.calls.remote())
    finally:
        for actor in actors:
            ray.kill(actor)
        if router is not None:
            router.stop()
        standins.kill()
        standins.wait()
    window = end["time"] - start["time"]
    # acceptances the controller ran in the window (the consumer's cursor moves a whole batch at a time, which
    # would round a 20 s window at batch 256 to a multiple of 12.8 groups/s)
    groups = sum(1 for name, t, _ in controller_calls if name == "complete" and start["time"] <= t <= end["time"])

    def window_ms(kind: str) -> tuple[float, float]:
        values = [d * 1e3 for worker in timings for t, d in worker[kind] if start["time"] <= t <= end["time"]]
        return percentile(values, 50), percentile(values, 99)

    in_window = [(name, d) for name, t, d in controller_calls if start["time"] <= t <= end["time"]]
    inside_complete = [d * 1e3 for name, d in in_window if name == "complete"]
    request_s = options.latency_s + options.response_tokens / options.tokens_per_s
    per_10k = 1e4 / groups if groups else float("nan")
    return Point(
        engines=engines,
        workers=workers,
        groups_in_flight=in_flight_groups,
        seconds=window,
        groups=groups,
        engine_cap_groups_per_s=in_flight_groups / request_s,
        lease_ms=window_ms("lease"),
        accept_ms=window_ms("complete"),
        accept_inside_ms=(percentile(inside_complete, 50), percentile(inside_complete, 99)),
        controller_busy=sum(d for _, d in in_window) / window,
        journal_bytes_per_10k=(end["journal"] - start["journal"]) * per_10k,
        store_bytes_per_10k=(end["store"] - start["store"]) * per_10k,
        controller_rss_mib=rss,
        cpu_share={name: sum(end["cpu"][name]) - sum(start["cpu"][name]) for name in start["cpu"]}
        | {"total": end["cpu_total"] - start["cpu_total"]},
    )


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine spent (user + nice + system + irq), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / CLOCK_TICKS


def snapshot(consumer, data_dir: str, pids: dict[str, list[int]]) -> dict:
    return {
        "time": time.time(),
        "cursor": consumer.cursor,
        "journal": dir_bytes(data_dir, journal_only=True),
        "store": dir_bytes(data_dir, journal_only=False),
        "cpu": {name: [cpu_seconds(p) for p in group] for name, group in pids.items()},
        "cpu_total": machine_busy_seconds(),
    }


class Consumer:
    """Takes accepted groups as `vime train --debug-rollout-only` does: take_groups_or_wait at the driver's cursor
    (a batch at a time, nothing trained, weights at version 0), then commit each step."""

    def __init__(self, controller, batch: int):
        self.controller, self.batch = controller, batch
        self.cursor, self.step, self.stop, self.error = 0, 0, False, None
        self.step_cursors: list[int] = []
        self.skipped: list[int] = []

    def loop(self) -> None:
        import ray

        from vime.train import GROUPS_WAIT_SECONDS

        try:
            while not self.stop:
                # full batches, as the driver takes them (a partial one only at the end of the data)
                taken = ray.get(
                    self.controller.take_groups_or_wait.remote(
                        self.cursor, self.batch, 0, 0, wait_seconds=GROUPS_WAIT_SECONDS
                    )
                )
                if not taken.groups:
                    continue
                self.step += 1
                self.skipped.extend(taken.skipped)
                self.step_cursors.append(taken.next_cursor)
                ray.get(self.controller.commit.remote(self.step, taken.next_cursor, self.step_cursors, self.skipped))
                self.cursor = taken.next_cursor
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            self.error = error


# ---------------------------------------------------------------------------------------------- report
def report(points: list[Point], options) -> None:
    print(
        f"\n== bench/scale: the control plane with stand-in engines ({options.n} samples a group, "
        f"{options.response_tokens}-token responses, {options.latency_s:g} s + {options.tokens_per_s:g} tok/s a "
        f"request, {options.in_flight_per_engine} requests in flight per engine)" + (" (smoke)" * options.smoke)
    )
    print(
        "  engines workers in-flight  window  groups/s  engine-cap  lease p50/p99 ms  accept p50/p99 ms"
        "  journal MiB/10k  store MiB/10k  ctrl RSS MiB"
    )
    for p in points:
        print(
            f"  {p.engines:7d} {p.workers:7d} {p.groups_in_flight:9d} {p.seconds:6.1f}s {p.groups_per_s:9.1f} "
            f"{p.engine_cap_groups_per_s:11.1f} {p.lease_ms[0]:8.1f}/{p.lease_ms[1]:<8.1f} "
            f"{p.accept_ms[0]:8.1f}/{p.accept_ms[1]:<8.1f} {p.journal_bytes_per_10k / 2**20:16.2f} "
            f"{p.store_bytes_per_10k / 2**20:14.1f} {p.controller_rss_mib:13.0f}"
        )
    print(
        "  CPU share over the window (100% = one core busy) and CPU per accepted group; the controller actor's one "
        "thread busy in calls:"
    )
    for p in points:
        shares = ", ".join(
            f"{name} {seconds / p.seconds:.0%}" + (f" ({seconds / p.groups * 1e3:.1f} ms/group)" if p.groups else "")
            for name, seconds in p.cpu_share.items()
            if name != "total"
        )
        shares += f", whole machine {p.cpu_share['total'] / p.seconds:.0%}"
        print(
            f"  {p.engines:7d}: {shares}; controller thread busy {p.controller_busy:.0%}, "
            f"complete inside the actor p50/p99 {p.accept_inside_ms[0]:.1f}/{p.accept_inside_ms[1]:.1f} ms"
        )
    last = points[-1]
    verdict = last.groups_per_s >= GOAL_GROUPS_PER_S and last.accept_ms[1] < GOAL_P99_ACCEPT_MS
    print(
        f"  goal at {last.engines} engines: >= {GOAL_GROUPS_PER_S:g} groups/s with p99 accept < "
        f"{GOAL_P99_ACCEPT_MS:g} ms: {'met' if verdict else 'not met'} ({last.groups_per_s:.1f} groups/s, "
        f"p99 accept {last.accept_ms[1]:.1f} ms)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[16, 64, 256], help="stand-in engines per point")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per point")
    parser.add_argument("--warmup-seconds", type=float, default=8.0, help="left out before each window")
    parser.add_argument("--engines-per-worker", type=int, default=64, help="one rollout worker per this many")
    parser.add_argument("--in-flight-per-engine", type=int, default=8, help="sample requests in flight per engine")
    parser.add_argument("--n", type=int, default=8, help="--n-samples-per-prompt")
    parser.add_argument("--response-tokens", type=int, default=64, help="tokens of every response")
    parser.add_argument("--tokens-per-s", type=float, default=400.0, help="a stand-in request's decode speed")
    parser.add_argument("--latency-s", type=float, default=0.05, help="a stand-in request's fixed time")
    parser.add_argument("--profile-controller", action="store_true", help="print the controller's cProfile")
    parser.add_argument("--smoke", action="store_true", help="seconds-long check; its numbers mean nothing")
    options = parser.parse_args()
    if options.smoke:
        options.engines, options.seconds, options.warmup_seconds = [2], 2.0, 1.0

    import ray

    from vime.tools.make_tiny_model import make_tiny_model

    work = tempfile.mkdtemp(prefix="vime-bench-scale-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True, _node_ip_address="127.0.0.1")
    points = []
    try:
        model = make_tiny_model(os.path.join(work, "model"), seed=0)
        for engines in options.engines:
            print(f"== {engines} stand-in engines", flush=True)
            points.append(run_point(engines, options, model, work))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    report(points, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
