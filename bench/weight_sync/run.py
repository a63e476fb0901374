"""Weight-sync pause, flush vs keep, on the digit-shift demo job (issue 20 point 3).

    PYTHONPATH=. .venv/bin/python bench/weight_sync/run.py --attach-engine HOST:PORT --model DIR [--steps 6]

Runs bench/async's command lines for async-flush (``--flush-cache-interval 1``: abort, flush, reload,
resume) and async-keep (``--flush-cache-interval 0 --partial-rollout``: pause in place) on one running
vLLM server, and prints per step what metrics.jsonl records: ``weight_sync_seconds`` (the driver's whole
synchronisation), ``weight_sync_publish_s`` (the trainer writing the version), the engine's load (copy,
pause, reload, resume, probe), ``weight_sync_pause_s`` (pause to resume) and, of it, vLLM's answer to
/pause alone; then the means over the steps after the first.

``--smoke`` (what `make test` runs, in seconds): without an engine it builds the tiny model and both modes'
command lines and checks that `vime train` accepts them (start-up validation), running nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "digit_shift"))


def _bench_async():
    spec = importlib.util.spec_from_file_location("bench_async_run", os.path.join(REPO, "bench", "async", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(run_dir: str, mode: str) -> dict[str, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if r["kind"] == "train"]
    syncs = {r["step"]: r for r in records if r["kind"] == "weight_sync"}
    rows = []
    for r in steps:
        s = syncs[r["step"]]
        row = {
            "sync": r["weight_sync_seconds"],
            "publish": r["weight_sync_publish_s"],
            "load": s["weight_load_seconds"],
            "pause": r["weight_sync_pause_s"],
            "pause_request": s.get("weight_pause_request_seconds", 0.0),
            "step": r["step_seconds"],
        }
        rows.append(row)
        print(f"  {mode:12s} step {r['step']:2d}: " + "  ".join(f"{k} {v:.3f}s" for k, v in row.items()), flush=True)
    mean = {k: statistics.fmean(row[k] for row in rows[1:]) for k in rows[0]}
    print(f"  {mode:12s} mean (steps 2..): " + "  ".join(f"{k} {v:.3f}s" for k, v in mean.items()), flush=True)
    return mean


def smoke(bench, modes: list[str]) -> int:
    from vime.tools.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="vime-bench-weight-sync-smoke-") as out:
        model = make_tiny_model(os.path.join(out, "model"))
        for mode in modes:
            args = bench.job_args(os.path.join(out, mode), model, 3, bench.MODES[mode], engine="127.0.0.1:1")
            if not bench.supported(args):
                raise SystemExit(f"bench/weight_sync --smoke: vime train refuses the {mode} command line")
    print(f"== bench/weight_sync --smoke: the command lines of {len(modes)} modes checked; no run")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attach-engine", metavar="HOST:PORT", default=None, help="a running vLLM server")
    parser.add_argument("--model", default=None, help="the HF model folder that server serves")
    parser.add_argument("--smoke", action="store_true", help="check the command lines only (no engine needed)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=["async-flush", "async-keep"])
    options = parser.parse_args()
    bench = _bench_async()
    if options.smoke:
        return smoke(bench, options.modes)
    if options.attach_engine is None or options.model is None:
        parser.error("--attach-engine HOST:PORT and --model DIR are needed (or --smoke)")
    out = tempfile.mkdtemp(prefix="vime-bench-weight-sync-")
    means = {}
    for mode in options.modes:
        run_dir = os.path.join(out, mode)
        args = bench.job_args(run_dir, options.model, options.steps, bench.MODES[mode], engine=options.attach_engine)
        print(f"\n== {mode}: vime train ... {' '.join(bench.MODES[mode])}  ({run_dir})", flush=True)
        if subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO).returncode != 0:
            raise SystemExit(f"the {mode} run failed (see {run_dir})")
        means[mode] = report(run_dir, mode)
    if {"async-flush", "async-keep"} <= means.keys():
        flush, keep = means["async-flush"], means["async-keep"]
        ratios = f"sync {keep['sync'] / flush['sync']:.2f}x, pause {keep['pause'] / flush['pause']:.2f}x"
        print(f"\n== keep / flush: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
