"""Every benchmark under bench/ still runs: its ``--smoke`` mode, as a user would start it.

A smoke run goes through the benchmark's own code on the smallest sizes and prints its usual result
line; the numbers mean nothing and are not checked. Here the parts that need no vLLM engine:
bench/queue's micro benchmark (real straw queue and Controller, Ray object store, torch files), the
calibration loop, bench/scale's control plane on 2 stand-in engines (real controller, straw queue,
vllm-router and rollout worker), the command lines bench/async, bench/elastic and bench/rollout hand to
`vime train` (parsed by it), bench/rollout's long-shape model (its EOS never sampled) and its idle lease loop
(a real controller actor at its staleness bound). Their runs on a real engine:
tests/e2e/test_bench_smoke_engine.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def run_smoke(script: str, *args: str, timeout: float) -> str:
    """Run ``bench/<script> --smoke ARGS`` from the repository root; its output (exit 0 asserted)."""
    result = subprocess.run(
        [sys.executable, os.path.join("bench", script), "--smoke", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"bench/{script} --smoke exited {result.returncode}:\n{output[-4000:]}"
    return result.stdout


# bench/memory's smoke on the configurations whose code differs: (b) is (c) without two of its flags and (c4)
# is (c) on 4 ranks; each configuration's ranks are fresh processes (~3.5 CPU-s each to import torch), and
# those two would add 6 of its 14. Of the Megatron backend's, (mt): megatron-core's path with recompute, chunked
# log-probs and tensor parallelism (its parameter count); (ma) and (mc) differ from it in flags only.
SMOKE_ARGS = {
    "memory/run.py": ["--configs", "a,c,d,mt"],
    # more flags for the jobs of (c) and (d): vime train parses them with the rest of each command line
    "rollout/run.py": ["--job-args", "--flush-cache-interval 0"],
}


@pytest.mark.parametrize(
    ("script", "result_line", "count"),
    [
        pytest.param("queue/run.py", "  ratio straw / object store = ", 2, id="queue"),  # plain, with SC heads
        pytest.param("calibrate_digit_shift.py", '"summary": true', 1, id="calibrate"),
        pytest.param("async/run.py", "== bench/async --smoke: the command lines of 4 modes checked", 1, id="async"),
        pytest.param("elastic/run.py", "== bench/elastic --smoke: the job's command line checked", 1, id="elastic"),
        pytest.param(
            "engine_faults/run.py",
            "== bench/engine_faults --smoke: the job's command line checked",
            1,
            id="engine_faults",
        ),
        pytest.param("memory/run.py", "ratio (c) / (a) per rank: ", 1, id="memory"),
        pytest.param(
            "weight_sync/run.py",
            "== bench/weight_sync --smoke: the command lines of 2 modes checked",
            1,
            id="weight_sync",
        ),
        pytest.param(
            "weight_sync/modes.py",
            "== bench/weight_sync/modes --smoke: full, delta and auto timed",
            1,
            id="weight_sync_modes",
        ),
        pytest.param(
            "rollout/run.py",
            "== bench/rollout --smoke: the models and the command lines of (c), (d), (cg) and (dg) checked for 2 "
            "shape(s)",
            1,
            id="rollout",
        ),
        pytest.param(
            "rollout/idle_lease.py", "  ratio after / before (CPU, median of 1 round(s)) = ", 1, id="idle_lease"
        ),
        pytest.param(
            "recovery/run.py", "== bench/recovery --smoke: the command lines of 3 runs checked", 1, id="recovery"
        ),
        # real controller, straw queue, vllm-router and rollout worker on 2 stand-in engines
        pytest.param("scale/run.py", "== bench/scale: the control plane with stand-in engines", 1, id="scale"),
    ],
)
def test_bench_smoke_without_engine(script, result_line, count):
    out = run_smoke(script, *SMOKE_ARGS.get(script, ()), timeout=240)
    assert out.count(result_line) == count, out[-4000:]
    if script == "async/run.py":
        # vime train accepted the command line of every mode (a refused one prints "skipped"); only
        # delta may be refused, by a build without delta weight updates (as the benchmark allows).
        sections = {chunk.split(":", 1)[0]: chunk for chunk in out.split("\n== ")[1:]}
        for mode in ("sync", "async-flush", "async-keep"):
            assert mode in sections and "(skipped:" not in sections[mode], out


def test_bench_rollout_refuses_a_job_flag_vime_train_refuses_before_starting_its_engine():
    """A --job-args flag that `vime train` refuses ends the benchmark, naming the flag, before its engine starts."""
    result = subprocess.run(
        [
            sys.executable,
            "bench/rollout/run.py",
            *("--shapes", "demo", "--modes", "a", "d", "--job-args", "--flush-cache-interval x"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "--flush-cache-interval" in result.stderr and "invalid int value: 'x'" in result.stderr, result.stderr[
        -2000:
    ]
    assert "starting the engine" not in result.stdout, result.stdout[-2000:]
