"""Reward for the digit-shift task: the fraction of the 3 answer positions that are right.

Partial credit gives GRPO a signal from the first step: a random-initialised model rarely gets all
three digits right, so an exact-match reward would leave most groups with zero advantage.
The recipe calibrated for this task is in docs/calibration-digit-shift.md.
"""

from __future__ import annotations

from typing import Any

EOS_TEXT = "<|endoftext|>"


def score(response: str, label: str) -> float:
    """Fraction of ``label``'s positions matched by ``response``'s first ``len(label)`` characters.

    The response ends at the first EOS text (as generation does), then whitespace is stripped;
    missing characters count as wrong, characters beyond ``len(label)`` are ignored.
    """
    if not label:
        return 0.0
    text = (response or "").split(EOS_TEXT, 1)[0].strip()
    hits = sum(1 for got, want in zip(text[: len(label)], label) if got == want)
    return hits / len(label)


def reward(args: Any, sample: Any) -> float:
    """vime custom reward function; reads only ``sample.response`` (decoded text) and ``sample.label``."""
    return score(sample.response, str(sample.label))
