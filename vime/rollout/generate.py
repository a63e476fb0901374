"""Generate through the router (vLLM's token-in/token-out endpoint ``/inference/v1/generate``).

A sample is continued from whatever it already holds: a fresh sample sends its prompt; a
continuation sends prompt + partial response and asks only for the remaining tokens, so every
token keeps the weight version that produced it.

Every request carries the sample's session id as the ``x-session-id`` header. vllm-router's
``consistent_hash`` policy hashes that header first (then ``x-user-id``, ..., then body fields, then
the whole body), so all turns of one session reach the same engine and reuse its prefix cache. The
other policies ignore it. Custom generate functions get the same behaviour from
:func:`generate_turn` (one more turn of a multi-turn sample) and :func:`append_observation` (a
tool's output, masked out of the loss).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

from vime.sample import Sample, Status

FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "cancelled": Status.ABORTED}
SESSION_HEADER = "x-session-id"
GENERATE_PATH = "/inference/v1/generate"


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


@dataclasses.dataclass(frozen=True)
class Completion:
    """One engine answer: the new tokens with their sampler log-probs and weight versions."""

    token_ids: list[int]
    log_probs: list[float] | None
    versions: list[int]
    finish_reason: str

    @property
    def status(self) -> Status:
        return FINISH_STATUS.get(self.finish_reason, Status.COMPLETED)


def parse_version(label: str) -> int:
    # An engine serves "default" until vime names its first version; that is version 0.
    return 0 if label == "default" else int(label)


def token_versions(segments: list[dict[str, Any]], count: int) -> list[int]:
    versions = [0] * count
    for segment in segments or []:
        for position in range(segment["start"], min(segment["end"], count)):
            versions[position] = parse_version(segment["version"])
    return versions


def session_headers(session_id: str | None) -> dict[str, str]:
    return {SESSION_HEADER: session_id} if session_id else {}


def router_url(args) -> str:
    """The router of the run, from the ``args`` user hooks receive."""
    return f"http://{args.vllm_router_ip}:{args.vllm_router_port}"


async def post_generate(http: aiohttp.ClientSession, base_url: str, token_ids: list[int],
                        sampling_params: dict[str, Any], *, session_id: str | None, timeout: float) -> Completion:
    """POST one generate request (``sampling_params`` in vLLM's names) with the session header."""
    url = base_url.rstrip("/") + GENERATE_PATH
    body = {"token_ids": list(token_ids), "sampling_params": sampling_params}
    try:
        async with http.post(url, json=body, headers=session_headers(session_id),
                             timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise GenerateError(f"POST {url} answered {response.status}: {(await response.text())[:300]}")
            output = await response.json()
    except TimeoutError:
        raise GenerateError(f"POST {url} timed out after {timeout:.0f}s (--rollout-request-timeout)") from None
    except aiohttp.ClientError as error:
        raise GenerateError(f"POST {url} failed: {error}") from None
    choice = output["choices"][0]
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    log_probs = [entry["logprob"] for entry in content] if len(content) == len(ids) else None
    return Completion(ids, log_probs, token_versions(choice.get("weight_versions"), len(ids)),
                      choice.get("finish_reason") or "stop")


async def generate(session: aiohttp.ClientSession, base_url: str, sample: Sample, params: SamplingParams,
                   *, timeout: float) -> Sample:
    remaining = params.max_new_tokens - sample.response_length
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    completion = await post_generate(session, base_url, sample.tokens, params.for_vllm(remaining),
                                     session_id=sample.session_id, timeout=timeout)
    sample.append_response_tokens(completion.token_ids, completion.log_probs, completion.versions)
    sample.status = completion.status
    return sample


def _vllm_params(sampling_params: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    params = {"max_tokens" if key == "max_new_tokens" else key: value for key, value in sampling_params.items()}
    params["max_tokens"] = max_new_tokens
    params.setdefault("logprobs", 0)
    return params


async def generate_turn(args, sample: Sample, sampling_params: dict[str, Any], *, max_new_tokens: int | None = None,
                        url: str | None = None, timeout: float | None = None) -> Completion:
    """Generate one more turn of ``sample`` (prompt + everything so far) and append it.

    For custom generate functions: the request goes to the run's router (or ``url``) with the
    sample's session id, so with ``--router-policy consistent_hash`` every turn of the sample lands
    on the engine that holds its prefix. The new tokens join the response with loss mask 1, their
    log-probs and weight versions; ``sample.status`` follows the finish reason.
    """
    limit = max_new_tokens if max_new_tokens is not None else int(sampling_params.get("max_new_tokens", 16))
    timeout = timeout if timeout is not None else float(getattr(args, "rollout_request_timeout", 120.0))
    async with aiohttp.ClientSession() as http:
        completion = await post_generate(http, url or router_url(args), sample.tokens,
                                         _vllm_params(sampling_params, limit), session_id=sample.session_id,
                                         timeout=timeout)
    log_probs = completion.log_probs
    if log_probs is None and sample.rollout_log_probs is not None:
        raise GenerateError("the engine returned no log-probs for a sample that has them")
    if sample.rollout_log_probs is None and sample.response_length > 0:
        log_probs = None  # earlier response tokens have none: keep the sample consistent (no log-probs)
    sample.append_response_tokens(completion.token_ids, log_probs, completion.versions)
    sample.status = completion.status
    return completion


def append_observation(sample: Sample, token_ids: list[int]) -> None:
    """Append tokens the model did not generate (a tool's output, an environment's reply) to the
    response: loss mask 0, log-prob 0 and the weight version of the token before them."""
    token_ids = list(token_ids)
    version = sample.weight_versions[-1] if sample.weight_versions else 0
    keeps_log_probs = sample.rollout_log_probs is not None or sample.response_length == 0
    log_probs = [0.0] * len(token_ids) if keeps_log_probs else None
    sample.append_response_tokens(token_ids, log_probs, [version] * len(token_ids), loss_mask=[0] * len(token_ids))
