"""What the GPU checks of this folder share (they are scripts, not pytest files; each imports this
module from its own folder): the exit status for "not runnable here", the main job's command line,
and setting one of its flags."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time

SKIP = 77
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # vime and tests.* from the checkout, whatever the working directory


INSTALL = {
    "vllm": "vLLM is not installed (pip install -e '.[gpu]')",
    "megatron.core": "megatron-core is not installed (pip install -e '.[gpu]')",
    "nixl": "NIXL is not installed (pip install nixl)",
}


def missing_gpu_stack(*modules: str, gpus: int = 1) -> str | None:
    """Why a GPU check cannot run here (a module of ``modules`` missing, fewer than ``gpus`` CUDA devices),
    or None."""
    for module in modules:
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
            return INSTALL.get(module, f"{module} is not installed")
    import torch

    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "no CUDA device"
    if torch.cuda.device_count() < gpus:
        return f"{torch.cuda.device_count()} GPU(s) here, {gpus} needed"
    return None


def skip(reason: str) -> int:
    print(f"SKIP: {reason}", flush=True)
    return SKIP


def demo_args(run_dir: str, model: str) -> list[str]:
    """The `vime train` flags of the main job (examples/digit_shift/run_demo.py)."""
    spec = importlib.util.spec_from_file_location(
        "vime_digit_shift_demo", os.path.join(REPO, "examples", "digit_shift", "run_demo.py")
    )
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.demo_args(run_dir, model)


def set_flag(args: list[str], flag: str, value: str) -> None:
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]


def run_vime_train(args: list[str], *, env: dict, timeout: float) -> list[str]:
    """Run ``vime train args`` from the checkout (command and outcome printed); the failures so far:
    none, or its non-zero exit status."""
    print("$ vime train " + " ".join(args), flush=True)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "vime.cli", "train", *args], cwd=REPO, env=env, timeout=timeout)
    print(f"run finished in {time.monotonic() - started:.0f}s with exit code {result.returncode}", flush=True)
    return [] if result.returncode == 0 else [f"vime train exited with {result.returncode}"]


# ---------------------------------------------------------------- the trainer-only checks (check_*_cuda.py)
COMPARED = ("loss", "grad_norm", "train_rollout_logprob_abs_diff")
# SGD, not AdamW, where two layouts or devices of the same step are compared: AdamW's first step moves each weight
# by about +-lr whatever its gradient's size, so a gradient of ~1e-9 (float rounding) would decide its direction,
# and the second step would compare rounding noise. The exact comparisons (resume, sleep) keep AdamW.
EXACT_ARITHMETIC = {"optimizer": "sgd", "lr": 0.1}


def compare_steps(
    name: str, got: list[dict], want: list[dict], tolerance: float, failures: list[str], keys=COMPARED
) -> None:
    """Each step's ``keys`` of ``got`` against ``want`` within ``tolerance`` relative (a failure per miss); prints the
    worst difference and the gradient norms."""
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in keys:
            a, b = float(g[key]), float(w[key])
            # Relative, but GRPO's first on-policy loss is ~0 (its advantages sum to zero): 1e-6 absolute floor.
            difference = abs(a - b) / max(abs(b), 1e-6 / tolerance)
            worst = max(worst, difference)
            if not math.isfinite(a) or difference > tolerance:
                failures.append(f"{name}: step {step + 1} {key} {a:.6g}, expected {b:.6g} (tolerance {tolerance})")
    norms = ", ".join(f"{float(m['grad_norm']):.6g}" for m in got)
    print(f"  {name}: worst relative difference {worst:.2e} (tolerance {tolerance}); grad norms {norms}", flush=True)


def compare_bf16_steps(got: list[dict], float32: list[dict], failures: list[str]) -> None:
    """--bf16 steps against float32's: gradient norms within 10% (bf16 keeps ~3 significant digits); prints the
    trainer/rollout log-prob gap, what precision costs."""
    for step, (g, w) in enumerate(zip(got, float32, strict=True)):
        print(
            f"  bf16 step {step + 1}: grad norm {g['grad_norm']:.5f} (float32 {w['grad_norm']:.5f}), log-prob "
            f"gap mean {g['train_rollout_logprob_abs_diff']:.2e}, "
            f"worst token {g['train_rollout_logprob_abs_diff_max']:.2e}",
            flush=True,
        )
        if abs(g["grad_norm"] - w["grad_norm"]) > 0.1 * abs(w["grad_norm"]):
            failures.append(f"bf16 step {step + 1} grad norm {g['grad_norm']:.5f} vs float32 {w['grad_norm']:.5f}")


def exact_float32() -> None:
    """float32 means float32 on the GPU too: TF32 matmuls would differ from the CPU by ~1e-3."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
