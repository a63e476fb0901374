"""R3 on the rollout side: the experts the engine routed each token to, recorded with the sample.

vLLM (0.32) captures them when the server runs with ``--enable-return-routed-experts``
(``EngineArgs.enable_return_routed_experts``). Each choice of a ``/inference/v1/generate`` (or
``/v1/completions``) response then has ``routed_experts``: a base64 string of ``.npy`` bytes holding an
array [tokens - 1, decoder layers, experts per token] (uint8 up to 256 experts, else uint16) of logical
expert ids: one row per token the engine ran through the model, i.e. every token of prompt + output but
the last sampled one. It is null when the request was aborted before any forward pass or the server
flag is off. The sampling parameter ``routed_experts_prompt_start`` skips the first rows: a
continuation (another turn, a resumed partial rollout) asks only for the rows it lacks.

The sample keeps them in ``Sample.rollout_routed_experts``, [len(tokens) - 1, layers, topk], the rows of
every decoder layer as vLLM reports them (a dense layer's row is unused); the Megatron trainer takes the
MoE layers' rows (``vime.backends.megatron_routing.sample_routes``).

A generate function records them after appending the new tokens::

    params = {**vllm_sampling_params, **routing_request(sample)}
    ... POST, then sample.append_response_tokens(...) ...
    record_routed_experts(sample, choice.get("routed_experts"), prompt_start=params["routed_experts_prompt_start"])
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from vime.sample import Sample

ENGINE_FLAG = "--enable-return-routed-experts"
RESPONSE_FIELD = "routed_experts"
REQUEST_FIELD = "routed_experts_prompt_start"


def decode_routed_experts(encoded: str) -> np.ndarray:
    """The [rows, layers, topk] array of a response's ``routed_experts`` string."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, OSError, TypeError) as error:
        raise ValueError(f"{RESPONSE_FIELD}: not base64 .npy bytes ({error})") from None
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{RESPONSE_FIELD}: expected an integer array [tokens - 1, layers, topk], got {array.dtype} {array.shape}"
        )
    return array


def routing_replay_engine_args(vllm_args: dict) -> dict[str, str | None]:
    """The vLLM flags R3 adds to every engine's (vime.engines.vllm_server also runs such an engine
    with vLLM's V2 model runner, which vLLM 0.32 needs to capture the experts)."""
    return {ENGINE_FLAG[2:]: None}


def routing_request(sample: Sample) -> dict[str, Any]:
    """The sampling parameter that asks for only the rows ``sample`` does not have yet."""
    recorded = 0 if sample.rollout_routed_experts is None else len(sample.rollout_routed_experts)
    return {REQUEST_FIELD: min(recorded, max(len(sample.tokens) - 1, 0))}


def record_routed_experts(sample: Sample, encoded: str | None, *, prompt_start: int = 0) -> None:
    """Store a response's routed experts in ``sample`` (whose tokens already include the response).

    The response's rows cover tokens ``prompt_start .. len(tokens) - 2``; the sample's earlier rows are
    kept before them. Raises ValueError when the rows are missing or do not cover the tokens.
    """
    if encoded is None:
        raise ValueError(f"the engine returned no {RESPONSE_FIELD} (is vLLM running with {ENGINE_FLAG}?)")
    rows = decode_routed_experts(encoded)
    if prompt_start:
        earlier = sample.rollout_routed_experts
        if earlier is None or len(earlier) < prompt_start:
            raise ValueError(
                f"{REQUEST_FIELD}={prompt_start}, but the sample has "
                f"{0 if earlier is None else len(earlier)} recorded rows"
            )
        earlier = np.asarray(earlier)[:prompt_start]
        if earlier.shape[1:] != rows.shape[1:]:
            raise ValueError(f"routed experts of shape {rows.shape[1:]} after rows of shape {earlier.shape[1:]}")
        rows = np.concatenate([earlier, rows])  # promotes uint8 + uint16
    expected = len(sample.tokens) - 1
    if len(rows) != expected:
        raise ValueError(f"{len(rows)} rows of routed experts for len(tokens) - 1 = {expected} tokens")
    sample.rollout_routed_experts = rows
