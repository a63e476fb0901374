"""Dynamic sampling filters (``--dynamic-sampling-filter-path``): keep or drop a finished group.

A filter is called once per scored group, as ``filter(args, samples)`` (sync or async), and returns
a :class:`DynamicFilterOutput` (or a plain bool). A dropped group is never trained: the rollout
worker records its task as *rejected* in the queue (a terminal stage, journaled with the reason)
and leases fresh prompts instead, until ``--rollout-batch-size`` accepted groups make a step. The
rejected prompt is not generated again in this epoch; the next epoch offers it again like any other
prompt. See docs/data-and-hooks.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vime.errors import UserError
from vime.sample import Sample

FLAG = "--dynamic-sampling-filter-path"


class FilterError(UserError, TypeError):
    """A filter returned something vime cannot interpret."""


@dataclasses.dataclass(frozen=True)
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # why a group was dropped; counted per reason in the worker's stats


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop groups whose rewards are all equal: their GRPO advantages are all zero (no signal)."""
    rewards = [float(s.reward) for s in samples]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    keep = std > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def interpret(result: Any, path: str) -> DynamicFilterOutput:
    """The filter's answer as a DynamicFilterOutput; anything but that or a bool is an error."""
    if isinstance(result, DynamicFilterOutput):
        return DynamicFilterOutput(bool(result.keep), None if result.keep else (result.reason or "filtered"))
    if hasattr(result, "keep") and not isinstance(result, (bool, int)):  # the reference framework's type
        keep = bool(result.keep)
        return DynamicFilterOutput(keep, None if keep else (getattr(result, "reason", None) or "filtered"))
    if isinstance(result, bool) or type(result).__name__ == "bool_":  # numpy/torch booleans too
        return DynamicFilterOutput(bool(result), None if result else "filtered")
    if (
        hasattr(result, "item")
        and getattr(result, "dtype", None) is not None
        and str(result.dtype) in ("bool", "torch.bool")
    ):
        return DynamicFilterOutput(bool(result.item()), None if result.item() else "filtered")
    raise FilterError(
        f"{FLAG} {path}: returned {result!r} ({type(result).__name__}); expected "
        "DynamicFilterOutput(keep=..., reason=...) or a bool"
    )
