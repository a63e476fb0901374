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

Score centering (``--use-score-centering``) also records the sampler's distribution at every response
token, from the engine's ``logprobs_mode=processed_logprobs`` log-probs (after temperature and top-p):
with ``--rollout-top-p 1`` the ``k`` most probable tokens (``k + 1`` are requested because vLLM's list
spends one entry on the sampled token when it lies outside the top ``k + 1``); with top-p < 1 the whole
vocabulary is requested and the tokens the top-p mask kept (finite log-probs) are its support.
:func:`score_centering_request` prepares such a request, :func:`sampler_rows` reads the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp
import numpy as np

from vime.errors import MemberDied
from vime.rollout import routing
from vime.sample import Sample, SamplerRows, Status

FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "cancelled": Status.ABORTED}
SESSION_HEADER = "x-session-id"
GENERATE_PATH = "/inference/v1/generate"
# vLLM's JSON answers carry -inf log-probs (tokens outside the top-p mask) as this value.
VLLM_LOGPROB_FLOOR = -9999.0


# Statuses with which an engine refuses a request because of the request itself (a prompt longer than
# the model's context, a malformed body): a retry elsewhere cannot help, and the sample is at fault.
# Every other status is the engine's fault (403 from a server without --enable-scale-out, 404, 5xx).
SAMPLE_FAULT_STATUSES = frozenset({400, 413, 422})


class GenerateError(MemberDied, RuntimeError):
    """A POST to a vLLM engine or router that got no usable answer; ``status`` is the HTTP status, None
    when none came (connection refused or dropped, timeout).

    ``engine_fault`` says who is to blame: the engine (no answer, a 5xx, a 4xx other than
    :data:`SAMPLE_FAULT_STATUSES`) or the sample (the engine refused this request, or answered in a way
    this sample's settings cannot use). Only the sample's faults spend a task's attempts
    (workers/rollout_worker.py); an engine fault sends the group back to the queue."""

    def __init__(self, message: str, *, status: int | None = None, engine_fault: bool | None = None):
        super().__init__(message)
        self.status = status
        self.engine_fault = (
            (status is None or status not in SAMPLE_FAULT_STATUSES) if engine_fault is None else engine_fault
        )

    def __reduce__(self):  # crosses Ray actor boundaries with its fields
        return _rebuild_generate_error, (type(self), str(self), self.status, self.engine_fault)

    @property
    def transient(self) -> bool:
        """Whether another attempt may succeed: no answer or a 5xx; a 4xx refuses the request itself."""
        return self.status is None or self.status >= 500


def _rebuild_generate_error(cls, message: str, status: int | None, engine_fault: bool):
    return cls(message, status=status, engine_fault=engine_fault)


@dataclasses.dataclass(frozen=True)
class ScoreCenteringCapture:
    """What score centering records per response token: the top ``top_k`` head, or with ``support``
    (rollout top-p < 1) the complete top-p support."""

    top_k: int
    support: bool

    @property
    def logprobs(self) -> int:
        """vLLM's ``logprobs`` request field: -1 is the whole vocabulary."""
        return -1 if self.support else self.top_k + 1


def score_centering_capture(top_k: int, top_p: float) -> ScoreCenteringCapture | None:
    """The capture of a run with ``--score-centering-top-k top_k`` (0: score centering off)."""
    return ScoreCenteringCapture(top_k, top_p < 1) if top_k > 0 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()  # --rollout-stop
    stop_token_ids: tuple[int, ...] = ()  # --rollout-stop-token-ids
    skip_special_tokens: bool = False  # --rollout-skip-special-tokens
    # --rollout-max-context-len (--eval-max-context-len): prompt + response never exceed it.
    max_context_len: int | None = None
    # --rollout-seed: each request gets a seed derived from it and the sample (request_seed); None: unseeded.
    seed: int | None = None
    # --score-centering-top-k when --use-score-centering is on, else 0: the rollout records the sampler's
    # heads (top-p 1) or supports (top-p < 1). Evaluation leaves it 0.
    score_centering_top_k: int = 0
    # --use-rollout-routing-replay: the rollout records the experts the engine chose (R3).
    routing_replay: bool = False

    @property
    def score_centering(self) -> ScoreCenteringCapture | None:
        return score_centering_capture(self.score_centering_top_k, self.top_p)

    def remaining(self, sample: Sample) -> int:
        """New tokens a request for ``sample`` may ask for: what --rollout-max-response-len leaves of the
        response and, with a context limit, what it leaves of prompt + response."""
        remaining = self.max_new_tokens - sample.response_length
        if self.max_context_len is not None:
            remaining = min(remaining, self.max_context_len - len(sample.tokens))
        return remaining

    def request_seed(self, sample: Sample) -> int | None:
        """The vLLM seed of the next request for ``sample``: a function of --rollout-seed, the sample's group,
        index and current length (a continuation draws anew), so a regenerated sample draws the same tokens."""
        if self.seed is None:
            return None
        return sample_seed(self.seed, sample.group_index, sample.index, len(sample.tokens))

    def for_vllm(self, remaining: int, *, seed: int | None = None) -> dict[str, Any]:
        capture = self.score_centering
        request = {
            "max_tokens": remaining,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "logprobs": capture.logprobs if capture else 0,
        }
        request.update(self._engine_fields())
        if seed is not None:
            request["seed"] = seed
        return request

    def _engine_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.stop:
            fields["stop"] = list(self.stop)
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        if self.skip_special_tokens:
            fields["skip_special_tokens"] = True
        return fields

    def as_dict(self) -> dict[str, Any]:
        """The form custom generate functions receive (the reference framework's key names)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            **self._engine_fields(),
        }


def sample_seed(base: int, group_index: int, index: int, length: int) -> int:
    """A 31-bit seed from --rollout-seed and a sample's position (group, index, tokens held)."""
    value = base
    for part in (group_index, index, length):
        value = (value * 1_000_003 + int(part) + 1) % 2_147_483_647
    return value


def sampling_params_from_rollout(rollout, **extra) -> SamplingParams:
    """The rollout's SamplingParams from its RolloutConfig (--rollout-* flags); ``extra`` sets the rest."""
    return SamplingParams(
        max_new_tokens=rollout.rollout_max_response_len,
        temperature=rollout.rollout_temperature,
        top_p=rollout.rollout_top_p,
        top_k=rollout.rollout_top_k,
        stop=tuple(rollout.rollout_stop or ()),
        stop_token_ids=tuple(rollout.rollout_stop_token_ids or ()),
        skip_special_tokens=rollout.rollout_skip_special_tokens,
        max_context_len=rollout.rollout_max_context_len,
        seed=rollout.rollout_seed,
        **extra,
    )


@dataclasses.dataclass(frozen=True)
class Completion:
    """One engine answer: the new tokens with their sampler log-probs and weight versions."""

    token_ids: list[int]
    log_probs: list[float] | None
    versions: list[int]
    finish_reason: str
    sampler: SamplerRows | None = None  # score centering: the sampler's heads / supports
    routed_experts: str | None = None  # R3: vLLM's encoded experts per token (vime.rollout.routing)

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


async def post_json(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
    timeout_flag: str | None = None,
) -> Any:
    """POST ``body`` to an engine endpoint and return its JSON answer; raises :class:`GenerateError`
    naming the URL (and ``timeout_flag``, the flag that set ``timeout``, when it timed out)."""
    try:
        async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise GenerateError(
                    f"POST {url} answered {response.status}: {(await response.text())[:300]}", status=response.status
                )
            return await response.json()
    except TimeoutError:
        raise GenerateError(
            f"POST {url} timed out after {timeout:.0f}s" + (f" ({timeout_flag})" if timeout_flag else "")
        ) from None
    except aiohttp.ClientError as error:
        raise GenerateError(f"POST {url} failed: {error}") from None


async def post_generate(
    http: aiohttp.ClientSession,
    base_url: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    session_id: str | None,
    timeout: float,
    capture: ScoreCenteringCapture | None = None,
) -> Completion:
    """POST one generate request (``sampling_params`` in vLLM's names) with the session header;
    ``capture`` reads the sampler's heads / supports from the answer (the request must ask for them)."""
    [completion] = await post_generate_choices(
        http, base_url, token_ids, sampling_params, session_id=session_id, timeout=timeout, capture=capture
    )
    return completion


async def post_generate_choices(
    http: aiohttp.ClientSession,
    base_url: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    session_id: str | None,
    timeout: float,
    capture: ScoreCenteringCapture | None = None,
) -> list[Completion]:
    """:func:`post_generate` for a request of ``sampling_params["n"]`` samples (1 when absent): one completion
    per sample, in the engine's choice order."""
    url = base_url.rstrip("/") + GENERATE_PATH
    body = {"token_ids": list(token_ids), "sampling_params": sampling_params}
    output = await post_json(
        http, url, body, timeout=timeout, headers=session_headers(session_id), timeout_flag="--rollout-request-timeout"
    )
    choices = sorted(output["choices"], key=lambda choice: choice.get("index", 0))
    wanted = int(sampling_params.get("n", 1))
    if len(choices) != wanted:
        raise GenerateError(f"POST {url} asked for {wanted} samples and got {len(choices)}", engine_fault=False)
    return [_completion(url, choice, capture) for choice in choices]


def _completion(url: str, choice: dict[str, Any], capture: ScoreCenteringCapture | None) -> Completion:
    """One choice of the answer from ``url``, as a :class:`Completion`."""
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    log_probs = [entry["logprob"] for entry in content] if len(content) == len(ids) else None
    sampler = None
    if capture is not None:
        if log_probs is None:
            raise GenerateError(
                f"POST {url}: score centering asked for log-probs, the engine returned "
                f"{len(content)} entries for {len(ids)} tokens",
                engine_fault=False,
            )
        sampler = sampler_rows(content, capture)
    return Completion(
        ids,
        log_probs,
        token_versions(choice.get("weight_versions"), len(ids)),
        choice.get("finish_reason") or "stop",
        sampler,
        choice.get(routing.RESPONSE_FIELD),
    )


def sampler_rows(content: list[dict[str, Any]], capture: ScoreCenteringCapture) -> SamplerRows:
    """The sampler's heads or supports from the ``logprobs.content`` entries of a generate answer."""
    ids_rows, log_prob_rows = [], []
    for position, entry in enumerate(content):
        candidates = entry.get("top_logprobs") or []
        ids = np.fromiter((c["token_id"] for c in candidates), np.int64, len(candidates))
        log_probs = np.fromiter((c["logprob"] for c in candidates), np.float64, len(candidates))
        if capture.support:
            keep = log_probs > VLLM_LOGPROB_FLOOR
            if entry["token_id"] not in ids[keep]:
                # The top-p mask always keeps the token it sampled; a sampled token outside the
                # finite support means the engine's log-probs are not the sampler's.
                raise GenerateError(
                    f"score centering: token {entry['token_id']} at response position "
                    f"{position} lies outside the top-p support the engine returned; the engines "
                    "must run with --vllm-logprobs-mode processed_logprobs",
                    engine_fault=False,
                )
            ids, log_probs = ids[keep], log_probs[keep]
        else:
            if len(candidates) < capture.top_k:
                raise GenerateError(
                    f"score centering: the engine returned {len(candidates)} top log-probs per "
                    f"token, --score-centering-top-k needs {capture.top_k}; start the engines "
                    f"with --vllm-max-logprobs >= {capture.top_k + 1}",
                    engine_fault=False,
                )
            # Stable, so that ties keep the engine's order.
            head = np.argsort(-log_probs, kind="stable")[: capture.top_k]
            ids, log_probs = ids[head], log_probs[head]
        ids_rows.append(ids)
        log_prob_rows.append(log_probs)
    if not capture.support:
        shape = (len(content), capture.top_k)
        return SamplerRows(
            np.asarray(ids_rows, np.int32).reshape(shape), np.asarray(log_prob_rows, np.float32).reshape(shape)
        )
    offsets = np.zeros(len(content) + 1, np.int64)
    np.cumsum([len(row) for row in ids_rows], out=offsets[1:])
    flat_ids = np.concatenate(ids_rows).astype(np.int32) if ids_rows else np.zeros(0, np.int32)
    flat_log_probs = np.concatenate(log_prob_rows).astype(np.float32) if ids_rows else np.zeros(0, np.float32)
    return SamplerRows(flat_ids, flat_log_probs, offsets)


async def generate(
    session: aiohttp.ClientSession, base_url: str, sample: Sample, params: SamplingParams, *, timeout: float
) -> Sample:
    if not sends_request(sample, params):
        return _truncated([sample])[0]
    request = params.for_vllm(params.remaining(sample), seed=params.request_seed(sample))
    if params.routing_replay:
        request.update(routing.routing_request(sample))
    completion = await post_generate(
        session,
        base_url,
        sample.tokens,
        request,
        session_id=sample.session_id,
        timeout=timeout,
        capture=params.score_centering,
    )
    _apply_completion(sample, completion, routes_request=request if params.routing_replay else None)
    return sample


def sends_request(sample: Sample, params: SamplingParams) -> bool:
    """Whether generating ``sample`` asks an engine (False: no room is left for a token, and :func:`generate` only
    marks it truncated)."""
    return params.remaining(sample) > 0


def _truncated(samples: list[Sample]) -> list[Sample]:
    for sample in samples:
        sample.status = Status.TRUNCATED
    return samples


def _apply_completion(sample: Sample, completion: Completion, *, routes_request: dict[str, Any] | None = None) -> None:
    """``completion`` appended to ``sample`` (tokens, log-probs, weight versions, sampler rows; the experts it routed
    to where ``routes_request`` asked for them), then its status set."""
    sample.append_response_tokens(
        completion.token_ids, completion.log_probs, completion.versions, sampler=completion.sampler
    )
    if routes_request is not None:
        _record_routes(sample, completion, routes_request)
    sample.status = completion.status


# How vLLM refuses a request of more samples than it takes: above its scheduler's --max-num-seqs ("sampling_params.n
# must be at most the server's max_num_seqs"), or above VLLM_MAX_N_SEQUENCES ("n must be at most 16384").
N_ABOVE_MAX_NUM_SEQS = "n must be at most"


def refused_for_n(error: GenerateError) -> bool:
    """Whether ``error`` is the engine refusing a group request's ``n`` (more samples than it takes at once)."""
    return error.status == 400 and N_ABOVE_MAX_NUM_SEQS in str(error)


async def generate_group(
    session: aiohttp.ClientSession, base_url: str, samples: list[Sample], params: SamplingParams, *, timeout: float
) -> list[Sample]:
    """--rollout-group-requests: fresh samples of one prompt (no response yet, the same tokens) in one request
    of ``n = len(samples)`` (vLLM samples each independently), each completion appended to its sample as
    :func:`generate` appends one. The first sample's session id routes the request."""
    first = samples[0]
    if not sends_request(first, params):
        return _truncated(samples)
    request = {**params.for_vllm(params.remaining(first)), "n": len(samples)}
    completions = await post_generate_choices(
        session,
        base_url,
        first.tokens,
        request,
        session_id=first.session_id,
        timeout=timeout,
        capture=params.score_centering,
    )
    for sample, completion in zip(samples, completions, strict=True):
        _apply_completion(sample, completion)
    return samples


def _record_routes(sample: Sample, completion: Completion, request: dict[str, Any]) -> None:
    try:
        routing.record_routed_experts(sample, completion.routed_experts, prompt_start=request[routing.REQUEST_FIELD])
    except ValueError as error:
        raise GenerateError(f"--use-rollout-routing-replay: {error}", engine_fault=False) from None


def _vllm_params(sampling_params: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    params = {"max_tokens" if key == "max_new_tokens" else key: value for key, value in sampling_params.items()}
    params["max_tokens"] = max_new_tokens
    params.setdefault("logprobs", 0)
    return params


# vLLM sampling fields that change the sampler's distribution beyond temperature and top-p, with their
# neutral values: score centering compares that distribution with the trainer's, which has none of them.
_NEUTRAL_SAMPLING = {
    "top_k": (-1, 0, None),
    "min_p": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "logit_bias": (None, {}),
}


def score_centering_request(
    args, sampling_params: dict[str, Any]
) -> tuple[dict[str, Any], ScoreCenteringCapture | None]:
    """For custom generate functions: ``sampling_params`` (vLLM's names) with the log-probs score
    centering needs, and the capture to give :func:`post_generate`; unchanged and None when
    ``args.use_score_centering`` is off.

    The request must sample as the run does (``--rollout-temperature``, ``--rollout-top-p``, no top-k,
    min-p, penalties or constrained decoding): the trainer scores that distribution. Pass the
    completion's ``sampler`` rows to :meth:`Sample.append_response_tokens`.
    """
    if not getattr(args, "use_score_centering", False):
        return sampling_params, None
    params = dict(sampling_params)
    for key, attribute in (("temperature", "rollout_temperature"), ("top_p", "rollout_top_p")):
        run_value = float(getattr(args, attribute, 1.0))
        if params.get(key) is not None and float(params[key]) != run_value:
            raise GenerateError(
                f"score centering: a request with {key} {params[key]} differs from "
                f"--{attribute.replace('_', '-')} {run_value}; per-request sampling changes are "
                "unsupported",
                engine_fault=False,
            )
        params[key] = run_value
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if params.get(key) not in neutral:
            raise GenerateError(
                f"score centering: the request sets {key}={params[key]!r}; the trainer cannot "
                f"score that distribution (see --use-score-centering)",
                engine_fault=False,
            )
    capture = score_centering_capture(int(args.score_centering_top_k), params["top_p"])
    params["logprobs"] = capture.logprobs
    return params, capture


async def generate_turn(
    args,
    sample: Sample,
    sampling_params: dict[str, Any],
    *,
    max_new_tokens: int | None = None,
    url: str | None = None,
    timeout: float | None = None,
) -> Completion:
    """Generate one more turn of ``sample`` (prompt + everything so far) and append it.

    For custom generate functions: the request goes to the run's router (or ``url``) with the
    sample's session id, so with ``--router-policy consistent_hash`` every turn of the sample lands
    on the engine that holds its prefix. The new tokens join the response with loss mask 1, their
    log-probs and weight versions; ``sample.status`` follows the finish reason. With
    ``--rollout-max-context-len`` the turn asks for no more than the context leaves (none left: the
    sample ends TRUNCATED without a request); with ``--rollout-seed`` it carries the sample's seed.
    """
    limit = max_new_tokens if max_new_tokens is not None else int(sampling_params.get("max_new_tokens", 16))
    context = getattr(args, "rollout_max_context_len", None)
    if context is not None:
        limit = min(limit, int(context) - len(sample.tokens))
        if limit <= 0:  # --rollout-max-context-len reached: nothing more may be generated
            sample.status = Status.TRUNCATED
            return Completion([], [], [], "length")
    timeout = timeout if timeout is not None else float(getattr(args, "rollout_request_timeout", 120.0))
    request, capture = score_centering_request(args, _vllm_params(sampling_params, limit))
    seed = getattr(args, "rollout_seed", None)
    if seed is not None and request.get("seed") is None:
        request["seed"] = sample_seed(int(seed), sample.group_index, sample.index, len(sample.tokens))
    replay = bool(getattr(args, "use_rollout_routing_replay", False))
    if replay:
        request.update(routing.routing_request(sample))
    async with aiohttp.ClientSession() as http:
        completion = await post_generate(
            http,
            url or router_url(args),
            sample.tokens,
            request,
            session_id=sample.session_id,
            timeout=timeout,
            capture=capture,
        )
    log_probs = completion.log_probs
    if log_probs is None and sample.rollout_log_probs is not None:
        raise GenerateError("the engine returned no log-probs for a sample that has them", engine_fault=False)
    if sample.rollout_log_probs is None and sample.response_length > 0:
        log_probs = None  # earlier response tokens have none: keep the sample consistent (no log-probs)
    sample.append_response_tokens(completion.token_ids, log_probs, completion.versions, sampler=completion.sampler)
    if replay:
        _record_routes(sample, completion, request)
    sample.status = completion.status
    return completion


def append_observation(sample: Sample, token_ids: list[int]) -> None:
    """Append tokens the model did not generate (a tool's output, an environment's reply) to the
    response: loss mask 0, log-prob 0, the weight version of the token before them and, with score
    centering, empty sampler rows."""
    token_ids = list(token_ids)
    version = sample.weight_versions[-1] if sample.weight_versions else 0
    keeps_log_probs = sample.rollout_log_probs is not None or sample.response_length == 0
    log_probs = [0.0] * len(token_ids) if keeps_log_probs else None
    sample.append_response_tokens(token_ids, log_probs, [version] * len(token_ids), loss_mask=[0] * len(token_ids))
