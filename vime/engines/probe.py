"""Probe before trust: one real generate request on the path rollouts use.

An engine whose ``/health`` answers 200 may still be unable to serve a rollout: a server started
without ``--enable-scale-out`` answers every ``POST /inference/v1/generate`` with 403, a half-loaded
model answers 500, a wrong build returns no log-probs or no weight versions. Behind a load-balancing
router such an engine is a black hole: it fails fast, so it looks like the least loaded engine and
draws most of the traffic. vime therefore sends every engine a tiny real request before it is
registered with the router (at start, when attached, after a restart, after every weight update)
and periodically while it serves (workers/health.py), and checks the answer:

- HTTP 200 with one choice carrying the generated token ids,
- a log-prob for each generated token (the trainer's importance ratios need them),
- the weight-version segments vLLM adds per token, and, when the caller knows it, the version the
  engine must serve.

A failed probe raises :class:`ProbeFailed` whose message names the cause and, where the cause is a
missing server option, the exact flag or variable to add (docs/elastic.md lists them all).
"""

from __future__ import annotations

from typing import Any

import requests

from vime.engines.http import EngineError

GENERATE_PATH = "/inference/v1/generate"
# Any model's vocabulary has these ids; one greedy token is enough to exercise the whole path.
PROBE_TOKEN_IDS = (1, 2, 3)
PROBE_SAMPLING = {"max_tokens": 1, "temperature": 0.0, "logprobs": 0}

# What each answer means when the generate path itself is refused (vLLM 0.32 answers 403 on the
# scale-out routes unless the server was started with --enable-scale-out, 404 on a build without them).
_STATUS_HINTS = {
    403: "the server refuses the token-in/token-out route; start it with --enable-scale-out",
    404: "the server has no /inference/v1/generate route; start a vLLM >= 0.32 server with --enable-scale-out",
    405: "the server has no POST /inference/v1/generate route; start a vLLM >= 0.32 server with --enable-scale-out",
}


class ProbeFailed(EngineError):
    """An engine failed its generation probe; the message says why (and what to change)."""

    role = "engine"


def probe_generation(url: str, *, timeout: float, expect_version: int | None = None) -> dict[str, Any]:
    """Send one generate request to ``url`` and check the answer; returns the choice.

    ``expect_version``: the weight version the engine must report for the generated token (vLLM
    labels the first version "default", which is version 0). A request that the engine aborted (a
    weight update paused it with ``mode=abort`` meanwhile) proves the route works and passes."""
    url = url.rstrip("/")
    body = {"token_ids": list(PROBE_TOKEN_IDS), "sampling_params": dict(PROBE_SAMPLING)}
    try:
        response = requests.post(url + GENERATE_PATH, json=body, timeout=timeout)
    except requests.Timeout:
        raise ProbeFailed(url, f"generation probe: POST {GENERATE_PATH} timed out after {timeout:g}s") from None
    except requests.RequestException as error:
        raise ProbeFailed(url, f"generation probe: POST {GENERATE_PATH} failed: {type(error).__name__}") from None
    if response.status_code != 200:
        hint = _STATUS_HINTS.get(response.status_code)
        raise ProbeFailed(
            url,
            f"generation probe: POST {GENERATE_PATH} answered {response.status_code}"
            + (f"; {hint}" if hint else f": {response.text[:200]}"),
        )
    try:
        choice = response.json()["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ProbeFailed(
            url, f"generation probe: POST {GENERATE_PATH} answered without choices: {response.text[:200]!r}"
        ) from None
    return check_choice(url, choice, expect_version)


def check_choice(url: str, choice: Any, expect_version: int | None) -> dict[str, Any]:
    """The checks of :func:`probe_generation` on one decoded choice (ProbeFailed when one fails)."""
    if not isinstance(choice, dict):
        raise ProbeFailed(url, f"generation probe: a choice that is not an object: {str(choice)[:200]}")
    if choice.get("finish_reason") == "abort":
        return choice
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise ProbeFailed(url, "generation probe: the answer carries no generated token ids")
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids) or not all(isinstance(entry.get("logprob"), (int, float)) for entry in content):
        raise ProbeFailed(
            url,
            f"generation probe: {len(content)} log-prob(s) for {len(ids)} token(s); the engine "
            "must return the sampled token's log-prob (do not start it with --max-logprobs 0)",
        )
    segments = choice.get("weight_versions")
    if not isinstance(segments, list) or not segments:
        raise ProbeFailed(
            url,
            "generation probe: the answer carries no weight_versions; vime needs vLLM's "
            "per-token weight versions (a vLLM >= 0.32 server with --enable-scale-out)",
        )
    if expect_version is not None:
        label = str(segments[-1].get("version"))
        served = 0 if label == "default" else label
        if str(served) != str(expect_version):
            raise ProbeFailed(
                url, f"generation probe: generated with weight version {label!r}, expected {expect_version}"
            )
    return choice
