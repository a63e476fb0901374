"""Return types of a custom ``--rollout-function-path`` function (the reference framework's names)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vime.sample import Sample


@dataclasses.dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]  # finished groups, each --n-samples-per-prompt samples
    metrics: dict[str, Any] | None = None


@dataclasses.dataclass
class RolloutFnEvalOutput:
    data: dict[str, Any]
    metrics: dict[str, Any] | None = None
