"""What the GPU checks of this folder share (they are scripts, not pytest files; each imports this
module from its own folder): the exit status for "not runnable here", the main job's command line,
and setting one of its flags."""

from __future__ import annotations

import importlib.util
import os
import sys

SKIP = 77
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # vime and tests.* from the checkout, whatever the working directory


def skip(reason: str) -> int:
    print(f"SKIP: {reason}", flush=True)
    return SKIP


def demo_args(run_dir: str, model: str) -> list[str]:
    """The `vime train` flags of the main job (examples/digit_shift/run_demo.py)."""
    spec = importlib.util.spec_from_file_location("vime_digit_shift_demo",
                                                  os.path.join(REPO, "examples", "digit_shift", "run_demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.demo_args(run_dir, model)


def set_flag(args: list[str], flag: str, value: str) -> None:
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
