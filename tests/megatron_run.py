"""`vime train` on the Megatron backend on CPU, as the tests and the CPU demo run it.

megatron-core needs CUDA in its forward pass; on CPU it runs only under the test-only shim
(tests/megatron_shim.py). The run attaches to a Ray head of its own (``--ray-address``: the trainer's node
checks for CUDA, not the driver's), and Ray's job config (``RAY_JOB_CONFIG_JSON_ENV_VAR``, as Ray's job
submission sets it) installs the shim in every worker process of the job; the head's workers find
``tests.megatron_shim`` through ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.integration.test_estimators_run import start_ray_head, stop_ray_head, wait_listening

SHIM_JOB_CONFIG = json.dumps({"runtime_env": {"worker_process_setup_hook": "tests.megatron_shim.install"}})


def run_on_megatron_shim(
    train_args: list[str], work_dir: str | os.PathLike[str], *, capture: bool = True, timeout: float | None = 600
) -> subprocess.CompletedProcess:
    """``vime train <train_args> --train-backend megatron`` on a Ray head of its own (its log in
    ``work_dir``/ray_head.log), the shim in every worker; ``capture``: keep the output (text) instead of
    printing it."""
    # megatron-core's model sets Transformer Engine's NVTE_*_ATTN variables in its process's environment, and
    # asserts that they agree with its attention backend: a model an earlier test built in this process (a
    # checkpoint conversion, say) must not hand its choice on to this run's workers.
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTE_")}
    env["PYTHONPATH"] = REPO
    log = Path(work_dir) / "ray_head.log"
    head, port = start_ray_head(log, env=env)
    try:
        wait_listening(head, port, log)
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "vime.cli",
                "train",
                *train_args,
                "--train-backend",
                "megatron",
                "--ray-address",
                f"127.0.0.1:{port}",
            ],
            cwd=REPO,
            capture_output=capture,
            text=True,
            timeout=timeout,
            env={**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": SHIM_JOB_CONFIG},
        )
    finally:
        stop_ray_head(head)
