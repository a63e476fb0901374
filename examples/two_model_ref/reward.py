"""Reward of the two-model example: the digit-shift score, minus a KL penalty against a frozen
reference model served by a second engine (``--vllm-config vllm_config.yaml``, model ``ref``).

For every scored sample the reference engine is asked for the log-probs of the sample's own
response tokens (``prompt_logprobs`` of prompt + response through ``/inference/v1/generate``).
The per-token estimate ``log p_actor - log p_ref`` (k1) is averaged over the response and kept in
``sample.metadata["ref_kl"]``; the reward is ``score - KL_COEF * ref_kl``.
"""

from __future__ import annotations

import importlib.util
import os

import aiohttp

from vime.rollout.vllm_rollout import get_model_url

_DIGIT_SHIFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "digit_shift", "reward.py")
_spec = importlib.util.spec_from_file_location("digit_shift_reward", _DIGIT_SHIFT)
digit_shift = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digit_shift)
score = digit_shift.score

KL_COEF = 0.1


async def reference_log_probs(
    url: str, tokens: list[int], start: int, *, session_id: str | None = None, timeout: float = 60.0
) -> list[float]:
    """Log-probs under the model at ``url`` of ``tokens[start:]``, each given the tokens before it."""
    body = {"token_ids": list(tokens), "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}}
    headers = {"x-session-id": session_id} if session_id else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            if reply.status != 200:
                raise RuntimeError(f"POST {url} answered {reply.status}: {(await reply.text())[:300]}")
            output = await reply.json()
    rows = output["prompt_logprobs"]
    return [rows[i][str(tokens[i])]["logprob"] for i in range(max(start, 1), len(tokens))]


async def reward(args, sample) -> float:
    task = score(sample.response, str(sample.label))
    if not sample.response_length or sample.rollout_log_probs is None:
        sample.metadata["ref_kl"] = 0.0
        return task
    ref = await reference_log_probs(
        get_model_url(args, "ref"), sample.tokens, sample.prompt_length, session_id=sample.session_id
    )
    kl = sum(a - r for a, r in zip(sample.rollout_log_probs, ref)) / len(ref)
    sample.metadata["ref_kl"] = kl
    return task - KL_COEF * kl
