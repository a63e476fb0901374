"""R3 on the rollout side, through vime's own generate path: the request asks only for the rows a
sample lacks, the answer's rows are stored per token across continuations, and a missing answer
fails naming the flag. vLLM 0.32 captures routed experts only with its V2 model runner, which needs
Triton and so does not run on CPU (checked: "Model Runner V2 requires Triton"): the engine is
replaced by a small HTTP server that answers the way vLLM's does (base64 .npy rows, one per token
it ran through the model, from ``routed_experts_prompt_start``)."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from vime.config import parse_train_args
from vime.rollout.generate import GenerateError, SamplingParams, generate
from vime.rollout.routing import REQUEST_FIELD
from vime.sample import Sample

LAYERS, TOPK = 2, 2


def experts_of(position: int) -> np.ndarray:
    """What the fake engine routes the token at ``position`` to (deterministic)."""
    return np.array([[(position + layer) % 4, (position + layer + 1) % 4] for layer in range(LAYERS)], np.uint8)


def encoded(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows)
    return base64.b64encode(buffer.getvalue()).decode()


async def serve(requests: list, *, with_routes: bool = True):
    async def generate_route(request):
        body = await request.json()
        requests.append(body["sampling_params"])
        tokens, new = body["token_ids"], [5, 6, 7][: body["sampling_params"]["max_tokens"]]
        start = body["sampling_params"].get(REQUEST_FIELD, 0)
        rows = np.stack([experts_of(p) for p in range(start, len(tokens) + len(new) - 1)])
        choice = {
            "token_ids": new,
            "finish_reason": "length",
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in new]},
            "routed_experts": encoded(rows) if with_routes else None,
        }
        return web.json_response({"choices": [choice]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate_route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def run_turns(sample: Sample, limits: list[int], *, with_routes: bool = True) -> list[dict]:
    async def main():
        requests: list = []
        runner, url = await serve(requests, with_routes=with_routes)
        try:
            async with aiohttp.ClientSession() as session:
                for limit in limits:
                    params = SamplingParams(max_new_tokens=sample.response_length + limit, routing_replay=True)
                    await generate(session, url, sample, params, timeout=10)
        finally:
            await runner.cleanup()
        return requests

    return asyncio.run(main())


def test_routes_cover_every_token_across_continuations():
    sample = Sample(prompt="12=", tokens=[1, 2, 3, 4], session_id="s")
    requests = run_turns(sample, [2, 3])  # a first part, then a continuation (as after a flush)
    assert [r[REQUEST_FIELD] for r in requests] == [0, 5]  # the continuation asks only for new rows
    routes = np.asarray(sample.rollout_routed_experts)
    assert routes.shape == (len(sample.tokens) - 1, LAYERS, TOPK) == (8, 2, 2)
    assert all((routes[p] == experts_of(p)).all() for p in range(len(routes)))


def test_an_engine_without_routes_fails_naming_the_flag():
    sample = Sample(prompt="12=", tokens=[1, 2, 3, 4], session_id="s")
    with pytest.raises(
        GenerateError,
        match="^--use-rollout-routing-replay: the engine returned no routed_experts "
        r"\(is vLLM running with --enable-return-routed-experts\?\)",
    ):
        run_turns(sample, [2], with_routes=False)


def test_r3_asks_the_engines_for_their_routes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = parse_train_args(
        [
            "--hf-checkpoint",
            str(tmp_path),
            "--prompt-data",
            "d.jsonl",
            "--rm-type",
            "exact_match",
            "--run-dir",
            str(tmp_path / "run"),
            "--use-rollout-routing-replay",
        ]
    )
    assert "enable-return-routed-experts" in settings.vllm.vllm_args
    plain = parse_train_args(
        [
            "--hf-checkpoint",
            str(tmp_path),
            "--prompt-data",
            "d.jsonl",
            "--rm-type",
            "exact_match",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert "enable-return-routed-experts" not in plain.vllm.vllm_args
