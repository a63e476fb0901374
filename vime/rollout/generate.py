"""Generate one sample through the router (vLLM's token-in/token-out endpoint).

A sample is continued from whatever it already holds: a fresh sample sends its prompt; a
continuation sends prompt + partial response and asks only for the remaining tokens, so every
token keeps the weight version that produced it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

from vime.sample import Sample, Status

FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "cancelled": Status.ABORTED}


class GenerateError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def for_vllm(self, remaining: int) -> dict[str, Any]:
        return {"max_tokens": remaining, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "logprobs": 0}

    def as_dict(self) -> dict[str, Any]:
        """The form custom generate functions receive (the reference framework's key names)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k}


def parse_version(label: str) -> int:
    # An engine serves "default" until vime names its first version; that is version 0.
    return 0 if label == "default" else int(label)


def token_versions(segments: list[dict[str, Any]], count: int) -> list[int]:
    versions = [0] * count
    for segment in segments or []:
        for position in range(segment["start"], min(segment["end"], count)):
            versions[position] = parse_version(segment["version"])
    return versions


async def generate(session: aiohttp.ClientSession, base_url: str, sample: Sample, params: SamplingParams,
                   *, timeout: float) -> Sample:
    remaining = params.max_new_tokens - sample.response_length
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    body = {"token_ids": sample.tokens, "sampling_params": params.for_vllm(remaining)}
    headers = {"x-session-id": sample.session_id} if sample.session_id else {}
    url = base_url + "/inference/v1/generate"
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise GenerateError(f"POST {url} answered {response.status}: {(await response.text())[:300]}")
            output = await response.json()
    except TimeoutError:
        raise GenerateError(f"POST {url} timed out after {timeout:.0f}s (--rollout-request-timeout)") from None
    except aiohttp.ClientError as error:
        raise GenerateError(f"POST {url} failed: {error}") from None
    choice = output["choices"][0]
    token_ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    log_probs = [entry["logprob"] for entry in content] if len(content) == len(token_ids) else None
    sample.append_response_tokens(token_ids, log_probs, token_versions(choice.get("weight_versions"), len(token_ids)))
    sample.status = FINISH_STATUS.get(choice.get("finish_reason") or "stop", Status.COMPLETED)
    return sample
