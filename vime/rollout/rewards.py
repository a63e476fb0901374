"""Reward functions: built-in ``--rm-type`` rules and user ``--custom-rm-path`` functions."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from vime.runtime.plugins import load_function
from vime.sample import Sample

RewardFn = Callable[[Any, Sample], Awaitable[float]]


def _normalise(text: Any) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().lower()


def exact_match(args, sample: Sample) -> float:
    return float(_normalise(sample.response) == _normalise(sample.label))


def f1(args, sample: Sample) -> float:
    predicted, gold = _normalise(sample.response).split(), _normalise(sample.label).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if not predicted or not gold or common == 0:
        return float(predicted == gold)
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def char_accuracy(args, sample: Sample) -> float:
    """Fraction of the label's characters reproduced at the same position."""
    gold, predicted = str(sample.label), str(sample.response).strip()
    if not gold:
        return float(not predicted)
    return sum(1 for g, p in zip(gold, predicted) if g == p) / len(gold)


BUILTIN = {"exact_match": exact_match, "f1": f1, "char_accuracy": char_accuracy}


def resolve_reward(rm_type: str | None, custom_rm_path: str | None) -> RewardFn:
    """An async reward(args, sample) for the configured reward; sync functions run in a thread."""
    if custom_rm_path:
        function = load_function(custom_rm_path, "--custom-rm-path", min_params=2)
    elif rm_type in BUILTIN:
        function = BUILTIN[rm_type]
    else:
        raise ValueError(f"--rm-type: unknown reward {rm_type!r}; choose one of {', '.join(BUILTIN)}")
    if inspect.iscoroutinefunction(function):
        return function

    async def call(args, sample: Sample) -> float:
        return function(args, sample)

    return call


async def score_group(reward: RewardFn, args, samples: list[Sample]) -> None:
    rewards = await asyncio.gather(*(reward(args, s) for s in samples))
    for sample, value in zip(samples, rewards):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"reward function returned {value!r} ({type(value).__name__}); expected a float")
        sample.reward = float(value)


def reward_by_source(samples: list[Sample]) -> dict[str, float]:
    """``{"reward_mean/<source>": mean reward}`` per ``sample.source_name`` (for per-source metrics)."""
    totals: dict[str, list[float]] = {}
    for sample in samples:
        if sample.reward is not None:
            totals.setdefault(sample.source_name, []).append(float(sample.reward))
    return {f"reward_mean/{name}": sum(values) / len(values) for name, values in sorted(totals.items())}
