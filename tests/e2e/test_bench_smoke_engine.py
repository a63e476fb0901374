"""The benchmarks that need a vLLM engine still run: their ``--smoke`` mode on the e2e session's engine.

Each is started as a user would (``bench/<name>/run.py --smoke --attach-engine HOST:PORT``) and runs
its own code on the smallest sizes: bench/queue's main-job comparison (two `vime train` runs,
object-store and straw), bench/async's ceiling (bench/rollout/ceiling.py) and sync run,
bench/engine_faults' job with a second engine that turns into a black hole and bench/elastic's job with
an engine added mid-run (in both, the same server under its other loopback name). The numbers mean
nothing and are not checked; each must exit 0 and print its result line. The engine-free parts:
tests/integration/test_bench_smoke.py, bench/rollout's --smoke among them (its router and rollout-only
runs on an engine took ~140 s of CI, over budget: they run in the full benchmark only).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import attached
from tests.integration.test_bench_smoke import run_smoke

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("script", "extra", "result_lines"),
    [
        pytest.param(
            "queue/run.py",
            ["--skip-micro"],
            ["  object-store ", "  straw ", "  ratio straw / object-store = "],
            id="queue",
        ),
        # One mode (sync: its steady-state figures against the ceiling and the trainer's rate): each run costs
        # ~15 s, mostly start-up, and the other modes differ only by their flags, which
        # tests/integration/test_bench_smoke.py checks.
        pytest.param(
            "async/run.py",
            ["--modes", "sync"],
            ["  sync ", "  ceiling (a): ", "  sync         / ceiling (a) = "],
            id="async",
        ),
        pytest.param(
            "engine_faults/run.py",
            [],
            [
                "  one engine ",
                "  one of them a black hole ",
                "  black hole / one engine = ",
                "failed tasks in the queue: 0",
            ],
            id="engine_faults",
        ),
        pytest.param(
            "elastic/run.py",
            [],
            [
                "  before (1 engine) ",
                "  after  (2 engines) ",
                "  after / before = ",
                "  vime engines add -> the new engine's first sample generated: ",
            ],
            id="elastic",
        ),
    ],
)
def test_bench_smoke_on_the_shared_engine(script, extra, result_lines, vllm_engine):
    with attached(vllm_engine) as engine_flags:  # the engine gets its original weights back afterwards
        out = run_smoke(
            script, "--attach-engine", engine_flags[1], "--model", vllm_engine.model_dir, *extra, timeout=400
        )
    report = out[out.rindex("\n== bench/" if script != "queue/run.py" else "\n== main job (digit shift") :]
    for line in result_lines:
        assert line in report, out[-4000:]
