"""Where a rollout function sends its requests once the engines run: :func:`get_model_url` (a model's
router) and :func:`prime_encoder` (an encoder engine, before the language engines).

Both read what the driver publishes on ``args`` after start-up (``args.vllm_model_routers``,
``args.vllm_model_encoder_endpoints``). Users import them from ``vime.rollout.vllm_rollout``, as the
reference framework's guide does.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

DEFAULT_GENERATE_PATH = "/inference/v1/generate"


def get_model_url(args: Any, name: str, path: str = DEFAULT_GENERATE_PATH) -> str:
    """The URL of ``path`` on the router of model ``name``, from ``args.vllm_model_routers``
    ({name: (ip, port)}, filled by the driver once the engines run; a URL string also works)."""
    routers = getattr(args, "vllm_model_routers", None)
    if not routers:
        raise RuntimeError("args.vllm_model_routers is empty: the engines of this run have not started yet")
    if name not in routers:
        raise ValueError(f"no model named {name!r}; served models: {', '.join(map(str, routers))}")
    return _base_url(routers[name]) + ("/" + path.lstrip("/") if path else "")


def _base_url(address: Any) -> str:
    if isinstance(address, str):
        return address.rstrip("/") if "://" in address else "http://" + address.rstrip("/")
    ip, port = address
    host = f"[{ip}]" if ":" in str(ip) else ip
    return f"http://{host}:{port}"


# OpenAI chat content parts the vision/audio tower encodes (JSON-serializable ones only).
_MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})


def media_parts(messages: Any) -> list[dict]:
    """The image/video/audio content parts of OpenAI-style chat messages."""
    parts = []
    for message in messages or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts += [
                dict(part) for part in content if isinstance(part, Mapping) and part.get("type") in _MEDIA_PART_TYPES
            ]
    return parts


async def prime_encoder(
    args: Any, messages: Any, model_name: str | None = None, *, session: Any = None, timeout: float = 120.0
) -> int:
    """Have an encoder engine embed every image of ``messages`` before the language engines run,
    so the embeddings are in the encoder cache when they look them up. Returns the number of
    media parts sent; 0 (a no-op) when there is none or the model has no encoder group.

    ``args.vllm_model_encoder_endpoints`` is {model: (served model name, [encoder URL])}. ``model_name``
    may be left out when exactly one model has encoders. Raises EngineError when an encoder fails.
    """
    endpoints = getattr(args, "vllm_model_encoder_endpoints", None) or {}
    if model_name is None:
        if len(endpoints) > 1:
            raise ValueError(f"several models have encoders ({', '.join(endpoints)}); pass model_name")
        model_name = next(iter(endpoints), None)
    entry = endpoints.get(model_name) if model_name is not None else None
    parts = media_parts(messages)
    if not entry or not entry[1] or not parts:
        return 0
    served_name, urls = entry

    import aiohttp  # imported here: the config package must stay light to import

    from vime.engines.http import EngineError

    async def encode(client: aiohttp.ClientSession, part: dict) -> None:
        url = random.choice(list(urls)).rstrip("/")
        body = {
            "model": served_name,
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
        }  # one token: enough to run the encoder path
        try:
            async with client.post(
                url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status >= 400:
                    text = await response.text()
                    raise EngineError(url, f"encoder priming answered {response.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise EngineError(url, f"encoder priming failed: {error!r}") from error

    if session is not None:
        await asyncio.gather(*(encode(session, part) for part in parts))
    else:
        async with aiohttp.ClientSession() as own:
            await asyncio.gather(*(encode(own, part) for part in parts))
    return len(parts)
