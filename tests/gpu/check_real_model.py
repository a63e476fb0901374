"""GPU check of the real-model features with the official (CUDA) vLLM. Not a pytest file.

    python tests/gpu/check_real_model.py [--num-rollout 40] [--keep DIR]

Needs one CUDA GPU and the official vLLM (``pip install -e '.[gpu,dev]'``). It runs the main job (the
digit-shift demo, examples/digit_shift/run_demo.py) with everything issue 16 added to the torch backend:

    --colocate (the engine sleeps, level 2, while the trainer trains; vime starts it with
      --enable-sleep-mode because the engine has a GPU)
    --bf16 (float32 masters; the engine serves float32)
    --use-distributed-optimizer (FSDP2; one rank here, two with --trainer-ranks 2)
    --use-dynamic-batch-size --max-tokens-per-gpu 256, --recompute-granularity full, --log-probs-chunk-size 64

and checks: the run succeeds; the held-out reward rises by at least --min-gain; every step reports the
trainer/engine log-prob gap (train_rollout_logprob_abs_diff mean and max, printed); the engine's log shows it
fell asleep every step and that sleep freed GPU memory ("Sleep mode freed ... GiB"); the GPU memory in use,
sampled with nvidia-smi while the run goes on, is reported (its peak, and its low while the engine sleeps).

The torch backend trains on the GPU beside the engine (vime.backends.torch_backend.training_device), so the
sampled GPU memory is both's. What it does not check: the Megatron backend's --bf16 or its
--use-distributed-optimizer (ZeRO-1); tests/gpu/check_torch_cuda.py checks the trainer alone on CUDA.

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU, no vLLM): the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from gpu_common import REPO, demo_args, missing_gpu_stack, run_vime_train, set_flag, skip

FEATURES = [
    "--train-backend",
    "torch",  # the default on a GPU machine is Megatron; this check is the torch trainer's (FSDP2, chunks)
    "--colocate",
    "--bf16",
    "--use-distributed-optimizer",
    "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
    "256",
    "--recompute-granularity",
    "full",
    "--log-probs-chunk-size",
    "64",
]


def gpu_memory_sampler(samples: list[int], stop: threading.Event) -> None:
    """MiB of GPU 0 in use, every half second, until ``stop``."""
    while not stop.is_set():
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            samples.append(int(out.strip().splitlines()[0]))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        stop.wait(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--min-gain", type=float, default=0.2, help="held-out reward rise required")
    parser.add_argument("--trainer-ranks", type=int, default=1, help="FSDP2 ranks (one GPU each)")
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800)
    options = parser.parse_args(argv)
    if reason := missing_gpu_stack("vllm"):
        return skip(reason)

    work = options.keep or tempfile.mkdtemp(prefix="vime-real-model-check-")
    os.makedirs(work, exist_ok=True)
    model, run_dir = os.path.join(work, "tiny-qwen2"), os.path.join(work, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run([sys.executable, "-m", "vime.cli", "tools", "make-tiny-model", model], check=True, cwd=REPO, env=env)
    args = demo_args(run_dir, model)
    set_flag(args, "--num-rollout", str(options.num_rollout))
    set_flag(args, "--eval-interval", str(max(1, options.num_rollout // 2)))
    set_flag(args, "--eval-temperature", "0")  # calibrated on greedy held-out reward
    set_flag(args, "--save-interval", str(max(1, options.num_rollout // 2)))
    args += FEATURES + ["--vllm-gpu-memory-utilization", "0.3", "--actor-num-gpus-per-node", str(options.trainer_ranks)]
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=gpu_memory_sampler, args=(samples, stop), daemon=True)
    sampler.start()
    try:
        failures = run_vime_train(args, env=env, timeout=options.timeout)
    finally:
        stop.set()
        sampler.join(timeout=5)

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    if len(evals) >= 2:
        first, last = evals[0]["eval_reward"], evals[-1]["eval_reward"]
        print(f"held-out reward: {first:.3f} -> {last:.3f}")
        if last < first + options.min_gain:
            failures.append(f"held-out reward rose by {last - first:.3f} < {options.min_gain}")
    else:
        failures.append(f"{len(evals)} evaluation(s) recorded, expected at least 2")
    gaps = [
        (r["train_rollout_logprob_abs_diff"], r["train_rollout_logprob_abs_diff_max"])
        for r in train
        if "train_rollout_logprob_abs_diff_max" in r
    ]
    if len(gaps) != len(train) or not train:
        failures.append("a step did not report the trainer/engine log-prob gap")
    else:
        print(
            f"trainer (bf16) vs engine log-probs: mean gap {sum(g for g, _ in gaps) / len(gaps):.2e}, "
            f"worst token {max(m for _, m in gaps):.2e}"
        )
    log = ""
    logs = os.path.join(run_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if name.startswith("engine-"):
            log += open(os.path.join(logs, name), errors="replace").read()
    asleep = len(re.findall(r"seconds to fall asleep", log))
    freed = re.findall(r"[Ss]leep mode freed ([0-9.]+) GiB", log)
    print(f"engine slept {asleep} time(s); freed per sleep (GiB): {freed[:5]}")
    if asleep < len(train):
        failures.append(f"the engine slept {asleep} time(s) in {len(train)} step(s)")
    if not freed or max(float(f) for f in freed) <= 0:
        failures.append("the engine's sleeps freed no GPU memory (was it started with --enable-sleep-mode?)")
    if samples:
        print(
            f"GPU memory in use: peak {max(samples)} MiB, lowest while running {min(samples)} MiB "
            f"({len(samples)} samples)"
        )
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures) + f"\nrun directory kept: {run_dir}", flush=True)
        return 1
    print(
        "PASS: bf16 + FSDP2 + token budgets + chunked log-probs train with a colocated, sleeping vLLM engine",
        flush=True,
    )
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
