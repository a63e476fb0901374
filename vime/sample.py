"""The unit of rollout data: one prompt's response with everything training needs.

Field names follow the reference framework's ``Sample`` so that custom rollout, generate and reward
functions written for it keep working.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplerRows:
    """The sampler's distribution at each of ``n`` new response tokens (score centering).

    Top-k heads: ``ids`` and ``log_probs`` are [n, k], full-vocabulary log-probs, ``offsets`` is None.
    Top-p support: ``ids`` and ``log_probs`` are flat, token ``t``'s support is entries
    ``offsets[t]:offsets[t + 1]`` (``offsets`` has n + 1 entries, from 0), its log-probs normalised on it.
    """

    ids: Any
    log_probs: Any
    offsets: Any = None

    @property
    def is_support(self) -> bool:
        return self.offsets is not None

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.is_support else len(self.ids)


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclasses.dataclass
class Sample:
    """One response. ``tokens`` = prompt tokens + response tokens.

    ``weight_versions[i]`` is the weight version that produced response token ``i``;
    ``rollout_log_probs[i]`` its log-probability under the sampler.
    """

    Status = Status

    group_index: int = -1  # index of the group (prompt task) inside the run
    index: int = -1  # index of the sample inside its group
    prompt_index: int = -1  # row of the prompt in --prompt-data
    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    reward: float | None = None
    status: Status = Status.PENDING
    rollout_log_probs: list[float] | None = None
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None  # set dynamically by custom data sources
    session_id: str | None = None
    # Optional captures, one row per token (tensors or arrays):
    rollout_routed_experts: Any = None  # R3: [len(tokens) - 1, layers, topk]
    rollout_topk_token_ids: Any = None  # score centering, top-k heads: [response_length, k]
    rollout_topk_log_probs: Any = None
    rollout_topp_ids: Any = None  # score centering, top-p support: flat ids ...
    rollout_topp_offsets: Any = None  # ... [response_length + 1] offsets into them ...
    rollout_topp_log_probs: Any = None  # ... and the normalised sampler log-probs
    teacher_log_probs: Any = None  # OPD: the teacher's log-prob of each response token [response_length]

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def get_reward_value(self, args=None) -> float | None:
        """The sample's scalar reward (the reference framework's accessor; vime has picked a dict reward's
        --reward-key entry when it scored the sample)."""
        return self.reward

    @property
    def source_name(self) -> str:
        """``sample.source``, then ``metadata["source_name"]``, else ``"unknown"`` (the seeds' rule)."""
        return self.source or self.metadata.get("source_name") or "unknown"

    def append_response_tokens(
        self,
        token_ids: list[int],
        log_probs: list[float] | None,
        versions: list[int],
        loss_mask: list[int] | None = None,
        *,
        sampler: SamplerRows | None = None,
    ) -> None:
        """Extend the response (a continuation appends to the prefix it resumed from).

        ``sampler``: the sampler's top-k heads or top-p supports of the new tokens (score centering).
        Tokens appended without them while the sample has some (a tool's output, loss mask 0) get
        empty rows, so that every capture keeps one row per response token.
        """
        if len(versions) != len(token_ids) or (log_probs is not None and len(log_probs) != len(token_ids)):
            raise ValueError("token_ids, log_probs and versions must have one entry per token")
        mask = list(loss_mask) if loss_mask is not None else [1] * len(token_ids)
        if len(mask) != len(token_ids):
            raise ValueError("loss_mask must have one entry per token")
        rows = self._sampler_rows(sampler, len(token_ids), trained=any(mask))
        self.tokens = self.tokens + list(token_ids)
        self.response_length += len(token_ids)
        self.weight_versions = self.weight_versions + list(versions)
        if log_probs is not None:
            self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)
        self.loss_mask = (self.loss_mask or []) + mask
        if rows is not None and rows.is_support:
            self.rollout_topp_ids, self.rollout_topp_offsets = rows.ids, rows.offsets
            self.rollout_topp_log_probs = rows.log_probs
        elif rows is not None:
            self.rollout_topk_token_ids, self.rollout_topk_log_probs = rows.ids, rows.log_probs

    def _sampler_rows(self, new: SamplerRows | None, count: int, *, trained: bool) -> SamplerRows | None:
        """The sample's sampler rows with ``new`` appended (None: the sample records none); validates
        before anything is changed, so a refused append leaves the sample as it was."""
        if self.rollout_topp_offsets is not None:
            old = SamplerRows(
                np.asarray(self.rollout_topp_ids),
                np.asarray(self.rollout_topp_log_probs),
                np.asarray(self.rollout_topp_offsets),
            )
        elif self.rollout_topk_token_ids is not None:
            old = SamplerRows(np.asarray(self.rollout_topk_token_ids), np.asarray(self.rollout_topk_log_probs))
        else:
            old = None
        if old is not None and len(old) != self.response_length:
            # A generate function that starts a sample over may reset its response and not the rows.
            if self.response_length:
                raise ValueError(
                    f"score centering: the sample holds sampler rows for {len(old)} tokens, its "
                    f"response has {self.response_length}"
                )
            old = None
        if new is None and old is None:
            return None
        if new is None:
            # Tokens the model did not sample carry no sampler distribution; trained ones must.
            if trained:
                raise ValueError(
                    f"score centering: {count} trained tokens appended without the sampler's "
                    "top-k heads / top-p supports of a sample that records them"
                )
            return _concat_rows(old, _empty_rows(old, count))
        new = _as_rows(new)
        if len(new) != count:
            raise ValueError(f"score centering: sampler rows for {len(new)} tokens, {count} tokens appended")
        if old is None:
            if self.response_length and any(self.loss_mask or [1] * self.response_length):
                raise ValueError("score centering: the sample's earlier trained tokens have no sampler rows")
            old = _empty_rows(new, self.response_length)
        if old.is_support != new.is_support or (not new.is_support and old.ids.shape[1] != new.ids.shape[1]):
            raise ValueError("score centering: the sampler rows appended differ in kind or size from the sample's")
        return _concat_rows(old, new)


# Rows without a recorded distribution: top-k heads of probability 0 (log-prob -inf), empty supports.
def _empty_rows(like: SamplerRows, count: int) -> SamplerRows:
    if like.is_support:
        return SamplerRows(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(count + 1, np.int64))
    k = like.ids.shape[1]
    return SamplerRows(np.zeros((count, k), np.int32), np.full((count, k), -np.inf, np.float32))


def _as_rows(rows: SamplerRows) -> SamplerRows:
    ids, log_probs = np.asarray(rows.ids, np.int32), np.asarray(rows.log_probs, np.float32)
    if rows.is_support:
        offsets = np.asarray(rows.offsets, np.int64)
        if (
            offsets.ndim != 1
            or len(offsets) == 0
            or offsets[0] != 0
            or np.any(np.diff(offsets) < 0)
            or ids.shape != log_probs.shape
            or ids.ndim != 1
            or offsets[-1] != len(ids)
        ):
            raise ValueError(
                "score centering: top-p support offsets must rise from 0 to the number of ids, with one log-prob per id"
            )
        return SamplerRows(ids, log_probs, offsets)
    if ids.ndim != 2 or ids.shape != log_probs.shape:
        raise ValueError(f"score centering: top-k heads of shape {ids.shape} / {log_probs.shape}, expected [n, k]")
    return SamplerRows(ids, log_probs)


def _concat_rows(old: SamplerRows, new: SamplerRows) -> SamplerRows:
    ids = np.concatenate([old.ids.astype(np.int32), new.ids])
    log_probs = np.concatenate([old.log_probs.astype(np.float32), new.log_probs])
    if not old.is_support:
        return SamplerRows(ids, log_probs)
    offsets = np.concatenate([old.offsets.astype(np.int64), old.offsets[-1] + new.offsets[1:]])
    return SamplerRows(ids, log_probs, offsets)
