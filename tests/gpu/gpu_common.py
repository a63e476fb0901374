"""What the GPU checks of this folder share (they are scripts, not pytest files; each imports this
module from its own folder): the exit status for "not runnable here", the main job's command line,
and setting one of its flags."""

from __future__ import annotations

import importlib.util
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
