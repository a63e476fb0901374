"""GPU check of a prefill/decode-disaggregated `--vllm-config` run with NIXL. Not a pytest file.

    python tests/gpu/check_pd_disaggregation.py [--num-rollout 20] [--keep DIR]

Needs one CUDA GPU (two are better: ``--gpus-per-engine`` placement is left to vLLM), the official
vLLM with NIXL (``pip install nixl``) and vime's GPU extras. It

1. builds vime's tiny Qwen2 (``vime tools make-tiny-model``);
2. runs the main job (the digit-shift demo of ``examples/digit_shift/run_demo.py``) with a
   ``--vllm-config`` that splits the actor into one prefill and one decode engine with vLLM's
   ``NixlConnector`` (vime's default for PD), both on the GPU the trainer uses
   (``gpu_memory_utilization`` 0.25 each);
3. checks that the run succeeded, that the actor's router ran in PD mode with both engines, that
   both engines served generate requests, that the decode engine received KV from the prefill
   engine (NIXL's transfer lines in its log), and that the held-out reward rose by ``--min-gain``.

The same topology runs on CPU in tests/e2e/test_sessions_and_hooks.py with vLLM's ExampleConnector.

Exit status: 0 all checks passed, 1 a check failed, 77 not runnable here (no GPU, no vLLM, no NIXL):
the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from gpu_common import REPO, demo_args, missing_gpu_stack, run_vime_train, set_flag, skip

CONFIG = """\
vllm:
  - name: actor
    update_weights: true
    server_groups:
      - worker_type: prefill
        num_gpus: 1
        overrides: {gpu_memory_utilization: 0.25}
      - worker_type: decode
        num_gpus: 1
        overrides: {gpu_memory_utilization: 0.25}
"""


def read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=20)
    parser.add_argument("--min-gain", type=float, default=0.1, help="held-out reward rise required")
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=1500)
    options = parser.parse_args(argv)

    if reason := missing_gpu_stack("vllm", "nixl"):
        return skip(reason)

    work = options.keep or tempfile.mkdtemp(prefix="vime-pd-check-")
    os.makedirs(work, exist_ok=True)
    model, run_dir, config = (os.path.join(work, n) for n in ("tiny-qwen2", "run", "pd.yaml"))
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(config, "w") as f:
        f.write(CONFIG)
    env = {**os.environ, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": REPO}
    vime = [sys.executable, "-m", "vime.cli"]
    subprocess.run(vime + ["tools", "make-tiny-model", model], check=True, cwd=REPO, env=env)
    args = demo_args(run_dir, model)
    set_flag(args, "--num-rollout", str(options.num_rollout))
    set_flag(args, "--eval-interval", str(options.num_rollout))
    set_flag(args, "--eval-temperature", "0")  # calibrated on greedy held-out reward
    args += ["--vllm-config", config, "--rollout-num-gpus", "2"]
    failures = run_vime_train(args, env=env, timeout=options.timeout)
    logs = os.path.join(run_dir, "logs")
    if "VllmPDRouter" not in read(os.path.join(logs, "router.log")):
        failures.append("the actor's router did not run in PD mode (no VllmPDRouter in logs/router.log)")
    for name in ("engine-0.log", "engine-1.log"):
        if '"POST /inference/v1/generate HTTP/1.1" 200' not in read(os.path.join(logs, name)):
            failures.append(f"{name}: served no generate request")
    if "nixl" not in read(os.path.join(logs, "engine-1.log")).lower():
        failures.append("the decode engine's log never mentions NIXL")
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            result_json = json.load(f)
        before = result_json["eval_before"].get("digit_shift_test")
        after = result_json["eval_after"].get("digit_shift_test")
        print(f"held-out reward: {before} -> {after}")
        if before is None or after is None or after < before + options.min_gain:
            failures.append(f"held-out reward rose from {before} to {after}, less than {options.min_gain}")
    else:
        failures.append("no summary.json")

    if failures:
        print("FAIL:\n  " + "\n  ".join(failures) + f"\nrun directory kept: {run_dir}", flush=True)
        return 1
    print("PASS: a PD-disaggregated actor (NIXL) trains the digit-shift task on one GPU", flush=True)
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
