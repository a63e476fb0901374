"""The unit of rollout data: one prompt's response with everything training needs.

Field names follow the reference framework's ``Sample`` so that custom rollout, generate and reward
functions written for it keep working.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


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

    group_index: int = -1          # index of the group (prompt task) inside the run
    index: int = -1                # index of the sample inside its group
    prompt_index: int = -1         # row of the prompt in --prompt-data
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
    source: str | None = None      # set dynamically by custom data sources
    session_id: str | None = None
    # Optional captures, one row per token (tensors or arrays):
    rollout_routed_experts: Any = None     # R3: [len(tokens) - 1, layers, topk]
    rollout_topk_token_ids: Any = None     # score centering, top-k heads: [response_length, k]
    rollout_topk_log_probs: Any = None
    rollout_topp_ids: Any = None           # score centering, top-p support: flat ids ...
    rollout_topp_offsets: Any = None       # ... [response_length + 1] offsets into them ...
    rollout_topp_log_probs: Any = None     # ... and the normalised sampler log-probs
    teacher_log_probs: Any = None          # OPD: the teacher's log-prob of each response token [response_length]

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    @property
    def source_name(self) -> str:
        """``sample.source``, then ``metadata["source_name"]``, else ``"unknown"`` (the seeds' rule)."""
        return self.source or self.metadata.get("source_name") or "unknown"

    def append_response_tokens(self, token_ids: list[int], log_probs: list[float] | None,
                               versions: list[int], loss_mask: list[int] | None = None) -> None:
        """Extend the response (a continuation appends to the prefix it resumed from)."""
        if len(versions) != len(token_ids) or (log_probs is not None and len(log_probs) != len(token_ids)):
            raise ValueError("token_ids, log_probs and versions must have one entry per token")
        self.tokens = self.tokens + list(token_ids)
        self.response_length += len(token_ids)
        self.weight_versions = self.weight_versions + list(versions)
        if log_probs is not None:
            self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)
        mask = list(loss_mask) if loss_mask is not None else [1] * len(token_ids)
        self.loss_mask = (self.loss_mask or []) + mask
