"""The main job: a real fully-asynchronous GRPO run on a tiny model, CPU only (`make demo`).

Builds a tiny random Qwen2 model and its character tokenizer offline, then runs `vime train` on the
digit-shift task (map each digit d of "371=" to (d + 1) mod 10: "482"; reward = fraction of the
three positions right). The held-out reward is printed before and after training.
Recipe: docs/calibration-digit-shift.md.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def demo_args(out: str, model: str) -> list[str]:
    return [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        os.path.join(HERE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--eval-prompt-data",
        "digit_shift_test",
        os.path.join(HERE, "test.jsonl"),
        "--custom-rm-path",
        os.path.join(HERE, "reward.py") + ":reward",
        "--rollout-shuffle",
        "--num-rollout",
        "80",
        "--rollout-batch-size",
        "64",
        "--n-samples-per-prompt",
        "8",
        "--rollout-max-response-len",
        "4",
        "--rollout-temperature",
        "1.0",
        "--lr",
        "1e-3",
        "--weight-decay",
        "0.01",
        "--eval-interval",
        "20",
        "--eval-temperature",
        "0",  # greedy held-out reward (docs/calibration-digit-shift.md); the default samples as the rollout
        "--advantage-estimator",
        "grpo",
        "--rollout-data-transport",
        "straw",
        "--run-dir",
        out,
        "--save",
        os.path.join(out, "checkpoints"),
        "--save-interval",
        "40",
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--seed",
        "1",
    ]


def main(extra: list[str]) -> int:
    """The demo's run; ``extra`` flags (the command line's) come after the recipe's, so they add to it or
    override it: ``run_demo.py --bf16 --num-rollout 120`` (`make demo ARGS="..."`)."""
    from vime.tools.make_tiny_model import make_tiny_model
    from vime.train import main as train_main

    out = os.path.join(REPO, "outputs", "digit_shift", time.strftime("%Y%m%d-%H%M%S"))
    model = os.path.join(REPO, "outputs", "digit_shift", "tiny-qwen2")
    make_tiny_model(model, seed=0)
    args = demo_args(out, model) + extra
    print("$ vime train " + " ".join(shlex.quote(a) for a in args), flush=True)
    started = time.monotonic()
    code = train_main(args)
    print(f"[demo] finished in {time.monotonic() - started:.0f}s with exit code {code}; run directory: {out}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
