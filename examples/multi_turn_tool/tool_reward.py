"""Reward of the multi-turn tool-use example: half for a correct tool result, half for the answer
(partial credit per character, so that a random model already sees different rewards)."""

from __future__ import annotations


def char_accuracy(text: str, label: str) -> float:
    return sum(1 for got, want in zip(text, label) if got == want) / max(len(label), 1)


def reward(args, sample) -> float:
    label = str(sample.label)
    tool = float(sample.metadata.get("tool_result") == label)
    return 0.5 * tool + 0.5 * char_accuracy(sample.metadata.get("answer", ""), label)
