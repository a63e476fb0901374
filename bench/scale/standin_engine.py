"""A STAND-IN for vLLM engines, for bench/scale only: many fake OpenAI-compatible engines in one process.

    .venv/bin/python bench/scale/standin_engine.py --engines 64 --first-port 30000 [--tokens-per-s 400]

This is not an engine. It exists because one machine cannot run 256 real vLLM engines, and bench/scale
measures what stands around the engines (the controller, the straw queue journal, vllm-router and the
rollout workers), not the engines. Every stand-in listens on its own port (``--engines`` ports from one
asyncio event loop) and answers what vime and vllm-router ask of a vLLM engine:

- ``POST /inference/v1/generate`` (vime's token-in/token-out request, vime.rollout.generate.post_generate):
  ``sampling_params.max_tokens`` token ids, one log-prob each (``logprobs.content``), the weight version
  segment vLLM reports (``weight_versions``, version "default" = 0) and ``finish_reason`` "length". The answer
  comes after ``--latency-s`` + max_tokens / ``--tokens-per-s`` seconds (asyncio.sleep: requests in flight
  do not slow each other down, an engine with an unbounded batch), so the fleet's capacity is known:
  in-flight requests / that time.
- ``GET /health``, ``/v1/models`` and any other GET (the router's and vime's probes): 200.

The token ids cycle through ``TOKEN_IDS`` (the digits of the demo's tiny tokenizer, never its EOS 0), so a
rollout worker decodes and scores them as usual. Started by bench/scale/run.py as a child process; it prints
``READY <first port>`` once every port listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

# The digits 0-9 of the demo's tiny tokenizer (vime.tools.make_tiny_model), which bench/scale's workers load.
TOKEN_IDS = tuple(range(1, 11))
LOG_PROB = -0.6931  # log(1/2): a plausible sampler log-prob; nothing reads its value


def completion_body(max_tokens: int, offset: int) -> bytes:
    """vLLM's generate answer for ``max_tokens`` new tokens (the fields vime reads)."""
    ids = [TOKEN_IDS[(offset + i) % len(TOKEN_IDS)] for i in range(max_tokens)]
    choice = {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": [{"logprob": LOG_PROB} for _ in ids]},
        "weight_versions": [{"start": 0, "end": max_tokens, "version": "default"}],
        "finish_reason": "length",
    }
    return json.dumps({"choices": [choice]}).encode()


class StandinEngine:
    """The request handlers of one stand-in engine (its counters are per port)."""

    def __init__(self, port: int, tokens_per_s: float, latency_s: float):
        self.port, self.tokens_per_s, self.latency_s = port, tokens_per_s, latency_s
        self.requests = 0
        self.in_flight = 0

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        max_tokens = int(body.get("sampling_params", {}).get("max_tokens", 16))
        self.requests += 1
        self.in_flight += 1
        try:
            await asyncio.sleep(self.latency_s + max_tokens / self.tokens_per_s)
        finally:
            self.in_flight -= 1
        return web.Response(body=completion_body(max_tokens, self.requests), content_type="application/json")

    async def probe(self, request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})
        if request.path == "/standin/stats":
            return web.json_response({"port": self.port, "requests": self.requests, "in_flight": self.in_flight})
        return web.json_response({"status": "ok", "standin": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_get("/{tail:.*}", self.probe)
        return app


async def serve(first_port: int, engines: int, tokens_per_s: float, latency_s: float, host: str) -> None:
    runners = []
    for port in range(first_port, first_port + engines):
        # access_log=None: a log line per request would cost more CPU than answering it
        runner = web.AppRunner(StandinEngine(port, tokens_per_s, latency_s).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        runners.append(runner)
    print(f"READY {first_port}", flush=True)
    await asyncio.Event().wait()  # until killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, required=True, help="stand-in engines (ports) to serve")
    parser.add_argument("--first-port", type=int, required=True, help="ports first-port .. first-port+engines-1")
    parser.add_argument("--tokens-per-s", type=float, default=200.0, help="decode speed of one request")
    parser.add_argument("--latency-s", type=float, default=0.05, help="fixed time per request (prefill, queueing)")
    parser.add_argument("--host", default="127.0.0.1")
    options = parser.parse_args()
    try:
        asyncio.run(serve(options.first_port, options.engines, options.tokens_per_s, options.latency_s, options.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
