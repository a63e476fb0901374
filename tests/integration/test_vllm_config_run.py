"""`vime train` refuses, before anything starts, the engine topologies it cannot start or cannot
train (the two-model run with a PD actor is in tests/e2e/test_sessions_and_hooks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_main_job import EXAMPLE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model")))


def run_vime_train(model_dir, tmp_path, *extra):
    argv = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model_dir,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--run-dir",
        str(tmp_path / "run"),
        *extra,
    ]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--prefill-num-servers", "1", "--rollout-num-gpus", "2", "--vllm-router-ip", "127.0.0.1"],
            "--vllm-router-ip: vime starts the prefill/decode engines of this topology, and a PD router learns its "
            "engines from its command line",
        ),
        ("two-trained", "--vllm-config: exactly one model must receive weight updates"),
        (
            "sglang-override",
            "--vllm-config: vllm[0].server_groups[0].overrides.mem_fraction_static: vLLM has no flag "
            "--mem-fraction-static (mem_fraction_static is SGLang's name; "
            "vLLM's is gpu_memory_utilization)",
        ),
    ],
)
def test_topologies_vime_cannot_start_or_train_fail_before_anything_starts(tmp_path, model_dir, flags, message):
    if flags == "two-trained":
        config = tmp_path / "two.yaml"
        config.write_text(
            "vllm:\n"
            "  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
            "  - name: b\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
        )
        flags = ["--vllm-config", str(config), "--rollout-num-gpus", "2"]
    elif flags == "sglang-override":
        config = tmp_path / "sglang.yaml"
        config.write_text(
            "vllm:\n  - name: actor\n    server_groups:\n"
            "      - {worker_type: regular, num_gpus: 1, overrides: {mem_fraction_static: 0.5}}\n"
        )
        flags = ["--vllm-config", str(config), "--rollout-num-gpus", "1"]
    result = run_vime_train(model_dir, tmp_path, *flags)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith("vime train: error: ") and message in result.stderr, result.stderr
    assert "starting Ray" not in result.stdout
