"""The main job once per advantage estimator: the same real stack (vLLM engine, router, straw queue,
trainer) as `make demo`, shorter, with `--advantage-estimator` set to each estimator in turn.

    .venv/bin/python examples/digit_shift/run_estimators.py [--num-rollout 20] [--estimators gspo ppo]

Each run is its own `vime train` process (one run per process). Prints, per estimator, the exit code,
the held-out reward before and after training and the wall time; exits non-zero if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from run_demo import demo_args  # noqa: E402

ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
# GSPO's clip is on a sequence-level ratio, far tighter than the token-level default (the seeds' values).
# REINFORCE++ whitens its advantages over the batch (the seeds): vime asks for the flag explicitly.
EXTRA = {
    "gspo": ["--eps-clip", "3e-4", "--eps-clip-high", "4e-4"],
    "reinforce_plus_plus": ["--normalize-advantages"],
    "reinforce_plus_plus_baseline": ["--normalize-advantages"],
}


def with_value(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def summary(run_dir: str) -> tuple[float | None, float | None]:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return None, None
    with open(path) as f:
        result = json.load(f)
    return result["eval_before"].get("digit_shift_test"), result["eval_after"].get("digit_shift_test")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=20)
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    options = parser.parse_args()

    from vime.tools.make_tiny_model import make_tiny_model

    root = os.path.join(REPO, "outputs", "estimators", time.strftime("%Y%m%d-%H%M%S"))
    model = os.path.join(REPO, "outputs", "digit_shift", "tiny-qwen2")
    make_tiny_model(model, seed=0)
    rows = []
    for estimator in options.estimators:
        run_dir = os.path.join(root, estimator)
        args = with_value(demo_args(run_dir, model), "--advantage-estimator", estimator)
        args = with_value(args, "--num-rollout", str(options.num_rollout))
        args = with_value(args, "--eval-interval", str(options.num_rollout))
        args += EXTRA.get(estimator, [])
        print(
            f"[estimators] {estimator}: vime train ... --advantage-estimator {estimator} "
            f"--num-rollout {options.num_rollout} (log: {run_dir}/train.log)",
            flush=True,
        )
        os.makedirs(run_dir, exist_ok=True)
        started = time.monotonic()
        with open(os.path.join(run_dir, "train.log"), "w") as log:
            code = subprocess.run(
                [sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        before, after = summary(run_dir)
        rows.append((estimator, code, before, after, time.monotonic() - started))
        print(f"[estimators] {estimator}: exit {code}, held-out reward {before} -> {after}", flush=True)
    print(f"\n{'estimator':<30} {'exit':>4} {'before':>7} {'after':>7} {'wall s':>7}")
    for estimator, code, before, after, seconds in rows:
        show = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{estimator:<30} {code:>4} {show(before):>7} {show(after):>7} {seconds:>7.0f}")
    return 0 if all(code == 0 for _, code, *_ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
