"""Engines vime did not start: addresses, and what their ``/server_info`` says about them.

An external engine is a vLLM server someone else launched (``--rollout-external-engine-addrs``,
``vime engines add``). vime never starts or kills it; it only reads its configuration, loads weight
versions into it from disk and registers it with the router. ``GET /server_info?config_format=json``
(vLLM's dev endpoints, ``VLLM_SERVER_DEV_MODE=1``) returns the engine's whole ``VllmConfig``; from
it vime infers:

- its GPU count: tensor x pipeline x data (local) x prefill-context parallel sizes, the worker
  processes a weight update reaches;
- its worker type: ``prefill`` / ``decode`` from ``kv_transfer_config.kv_role`` (``kv_producer`` /
  ``kv_consumer``), ``encoder`` from ``ec_transfer_config.ec_role == "ec_producer"``, else
  ``regular``;
- the model path it serves.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from vime.engines.http import EngineError, call_json

_ADDRESS = re.compile(r"(?:(https?)://)?([^\s/:\[\]]+|\[[0-9a-fA-F:.]+\]):(\d+)/?")


def engine_url(address: str) -> str:
    """``host:port`` or ``http://host:port[/]`` -> ``http://host:port``; ValueError otherwise."""
    match = _ADDRESS.fullmatch(address.strip())
    if not match or not 0 < int(match[3]) < 65536:
        raise ValueError(f"{address!r} is not host:port or http://host:port")
    return f"{match[1] or 'http'}://{match[2]}:{int(match[3])}"


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What vime needs to know about an engine it did not start."""

    url: str
    model: str | None
    gpus: int  # worker GPUs (slots) of the engine
    tensor_parallel_size: int
    worker_type: str  # regular | prefill | decode | encoder


def facts_from_server_info(url: str, info: Any) -> EngineFacts:
    """Parse ``/server_info?config_format=json``; EngineError when it is not what vLLM answers."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        raise EngineError(
            url,
            "GET /server_info did not return a JSON vllm_config (is it a vLLM server started "
            "with VLLM_SERVER_DEV_MODE=1?)",
        )
    parallel = config.get("parallel_config") or {}

    def size(name: str) -> int:
        value = parallel.get(name, 1)
        return int(value) if isinstance(value, (int, float)) and value >= 1 else 1

    tp = size("tensor_parallel_size")
    dp = size("data_parallel_size_local") if "data_parallel_size_local" in parallel else size("data_parallel_size")
    gpus = tp * size("pipeline_parallel_size") * dp * size("prefill_context_parallel_size")
    kv_role = (config.get("kv_transfer_config") or {}).get("kv_role")
    ec_role = (config.get("ec_transfer_config") or {}).get("ec_role")
    worker_type = (
        "encoder"
        if ec_role == "ec_producer"
        else {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role, "regular")
    )
    model = (config.get("model_config") or {}).get("model")
    return EngineFacts(
        url=url, model=str(model) if model else None, gpus=gpus, tensor_parallel_size=tp, worker_type=worker_type
    )


def probe_engine(url: str, *, timeout: float, wait: float = 0.0, poll_interval: float = 1.0) -> EngineFacts:
    """Wait up to ``wait`` seconds for ``url`` to answer /health, then read its /server_info.

    Every call is bounded by ``timeout``; the error names the engine and what failed.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            call_json("GET", url, "/health", timeout=min(timeout, 10.0), attempts=1)
            break
        except EngineError as error:
            if time.monotonic() >= deadline:
                raise EngineError(url, f"not healthy{f' after {wait:g}s' if wait else ''}: {error.message}") from None
        time.sleep(poll_interval)
    # The first /server_info call collects the system environment (slow once, cached after).
    info = call_json(
        "GET", url, "/server_info", params={"config_format": "json"}, timeout=max(timeout, 60.0), attempts=2
    )
    return facts_from_server_info(url, info)
