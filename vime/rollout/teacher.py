"""Teacher log-probs for on-policy distillation (``--use-opd``), collected on the rollout side.

A frozen teacher engine scores the student's sampled sequence: one request to vLLM's token-in
endpoint ``/inference/v1/generate`` (the one :mod:`vime.rollout.generate` uses) with the whole
sequence as ``token_ids`` and ``prompt_logprobs: 0`` returns log p_teacher(token_t | tokens_<t) for
every token after the first; those of the response become ``sample.teacher_log_probs`` (one per
response token, tool output included: the trainer's loss mask decides what counts). vLLM needs
``max_tokens >= 1``: one token is generated and discarded.

The teacher is ``--opd-teacher-url`` (a vLLM engine or router serving the teacher), or
``--opd-teacher-model NAME``, a model of ``--vllm-config`` (typically frozen: ``update_weights:
false``) found through :func:`vime.config.vllm_config.get_model_url`. The teacher must share the
student's tokenizer: the scores are per token id.

Temperature: vLLM's prompt log-probs are the raw model's (temperature 1), while the trainer scores
the student at ``--rollout-temperature``; with a temperature other than 1 the penalty compares the
tempered student with the untempered teacher.

Wiring: with ``--use-opd`` the rollout worker scores every finished group
itself (``workers/rollout_worker.py``), after the reward and the dynamic filter, and only the samples
that have no ``teacher_log_probs`` yet: a reward or rollout hook that attaches them itself (with
:func:`attach_teacher_log_probs`, or ``--custom-rm-path vime.rollout.teacher.reward_func`` for pure
distillation: reward 0) is not scored twice. Each request is bounded by ``--rollout-request-timeout``
and retried (:data:`TEACHER_ATTEMPTS`) when the teacher did not answer or answered 5xx; the final error
names the teacher's URL.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp

from vime.errors import UserError
from vime.rollout.generate import GENERATE_PATH, GenerateError, post_json
from vime.sample import Sample

# A teacher restarting or overloaded answers 5xx or not at all: two more tries, 1 s then 2 s apart, so that a
# group waits at most 3 x --rollout-request-timeout + 3 s before it fails (and goes back to the queue).
TEACHER_ATTEMPTS = 3
TEACHER_RETRY_DELAY = 1.0


class TeacherError(UserError, RuntimeError):
    """The teacher could not score a sequence (``transient``: a retry may succeed)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def teacher_base_url(args: Any) -> str:
    """The teacher's base URL from ``args`` (--opd-teacher-url, else --opd-teacher-model's router)."""
    url = getattr(args, "opd_teacher_url", None)
    if url:
        return url.rstrip("/") if "://" in url else "http://" + url.rstrip("/")
    model = getattr(args, "opd_teacher_model", None)
    if model:
        from vime.rollout.model_routes import get_model_url

        try:
            return get_model_url(args, model, path="")
        except (RuntimeError, ValueError) as error:
            raise TeacherError(f"--opd-teacher-model {model}: {error}") from None
    raise TeacherError(
        "--use-opd needs a teacher to score the samples: give --opd-teacher-url or "
        "--opd-teacher-model, or attach sample.teacher_log_probs in the reward or rollout function"
    )


def score_request(token_ids: list[int]) -> dict[str, Any]:
    """The body asking for the log-prob of every token of ``token_ids`` after the first."""
    return {
        "token_ids": [int(t) for t in token_ids],
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
    }


def _logprob_of(entry: Any, token: int) -> float | None:
    if not isinstance(entry, dict):
        return None
    value = entry.get(str(token), entry.get(token))
    if isinstance(value, dict):
        value = value.get("logprob")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_prompt_logprobs(prompt_logprobs: Any, token_ids: list[int]) -> list[float]:
    """[log p(token_t | tokens_<t) for t = 1 .. n-1] from vLLM's ``prompt_logprobs``: one entry per
    token, None for the first, else {token id: {"logprob": x, "rank": r, ...}} holding the token itself."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != len(token_ids):
        size = len(prompt_logprobs) if isinstance(prompt_logprobs, list) else type(prompt_logprobs).__name__
        raise TeacherError(
            f"the teacher returned prompt_logprobs of {size} entries for {len(token_ids)} tokens "
            "(does it serve /inference/v1/generate with prompt_logprobs?)"
        )
    scores = []
    for position in range(1, len(token_ids)):
        value = _logprob_of(prompt_logprobs[position], int(token_ids[position]))
        if value is None:
            raise TeacherError(
                f"the teacher's prompt_logprobs have no entry for token {token_ids[position]} at position {position}"
            )
        if math.isnan(value):
            raise TeacherError(f"the teacher returned a NaN log-prob at position {position}")
        scores.append(max(value, -1e4))  # -inf (a token the teacher cannot produce) as vLLM clamps it
    return scores


async def score_tokens(
    http: aiohttp.ClientSession, base_url: str, token_ids: list[int], *, timeout: float
) -> list[float]:
    """The teacher's log-prob of each token of ``token_ids`` after the first (len(token_ids) - 1 values)."""
    url = base_url.rstrip("/") + GENERATE_PATH
    try:
        output = await post_json(http, url, score_request(token_ids), timeout=timeout)
    except GenerateError as error:
        raise TeacherError(str(error), transient=error.transient) from None
    return parse_prompt_logprobs(output.get("prompt_logprobs") if isinstance(output, dict) else None, token_ids)


async def teacher_log_probs(
    http: aiohttp.ClientSession, base_url: str, sample: Sample, *, timeout: float, attempts: int = TEACHER_ATTEMPTS
) -> list[float]:
    """The teacher's log-prob of each response token of ``sample`` (``response_length`` values), retrying a
    teacher that did not answer; the error names the teacher's URL and the sample."""
    if sample.response_length == 0:
        return []
    if sample.prompt_length < 1:
        raise TeacherError(
            f"sample {sample.index} of group {sample.group_index} has no prompt token: the first "
            "response token cannot be scored"
        )
    attempt = 1
    while True:
        try:
            scores = await score_tokens(http, base_url, sample.tokens, timeout=timeout)
            return scores[sample.prompt_length - 1 :]
        except TeacherError as error:
            if not error.transient or attempt >= attempts:
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise TeacherError(
                    f"the OPD teacher at {base_url} could not score sample {sample.index} of group "
                    f"{sample.group_index}{tries}: {error}",
                    transient=error.transient,
                ) from None
        await asyncio.sleep(TEACHER_RETRY_DELAY * 2 ** (attempt - 1))
        attempt += 1


async def attach_teacher_log_probs(
    args: Any,
    samples: list[Sample],
    *,
    url: str | None = None,
    timeout: float | None = None,
    http: aiohttp.ClientSession | None = None,
    attempts: int = TEACHER_ATTEMPTS,
) -> None:
    """Set ``teacher_log_probs`` on each of ``samples`` (scored concurrently) from the run's teacher; none
    is set unless all are scored. ``http``: a session to reuse (the rollout worker's), else one of its own."""
    base_url = url or teacher_base_url(args)
    timeout = timeout if timeout is not None else float(getattr(args, "rollout_request_timeout", 120.0))

    async def score_all(session: aiohttp.ClientSession) -> list[list[float]]:
        tasks = [
            asyncio.ensure_future(teacher_log_probs(session, base_url, s, timeout=timeout, attempts=attempts))
            for s in samples
        ]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            # The group fails as a whole: the other samples' requests (and retries) would only load the teacher.
            for task in tasks:
                task.cancel()
            raise

    if http is not None:
        scores = await score_all(http)
    else:
        async with aiohttp.ClientSession() as session:
            scores = await score_all(session)
    for sample, values in zip(samples, scores):
        sample.teacher_log_probs = values


async def reward_func(args: Any, sample: Sample) -> float:
    """``--custom-rm-path vime.rollout.teacher.reward_func``: pure distillation. Attaches the teacher's
    log-probs and returns reward 0, so the advantages are the distillation penalty alone."""
    await attach_teacher_log_probs(args, [sample])
    return 0.0
