"""How a rollout's samples are split into micro-batches (docs/real-models.md, "Token budgets").

Pure functions over sample token counts: they return lists of sample indices (positions in the rollout), so
the backends decide only how to pack the tensors.

- Fixed micro-batches (the default): ``--micro-batch-size`` consecutive samples each, ``--global-batch-size //
  --micro-batch-size`` of them per optimizer step.
- Dynamic micro-batches (``--use-dynamic-batch-size``): each optimizer step still trains ``--global-batch-size``
  consecutive samples; inside a step, samples are packed first-fit decreasing so that a micro-batch holds at
  most ``--max-tokens-per-gpu`` tokens (a longer sample gets a micro-batch of its own). The no-gradient
  forwards (old and reference log-probs, critic values) pack consecutive samples up to
  ``--log-probs-max-tokens-per-gpu``: the advantages are computed in rollout order (group baselines).
- Equal shares (``multiple``): ranks that exchange tokens inside every forward (the Megatron backend's expert
  parallelism) must each run as many micro-batches as the others in every pass. Each step's micro-batches and
  the forwards' are then split further (:func:`split_to_multiple`) until their count is a multiple of the
  data-parallel ranks, and ``--balance-data`` gives every rank the same number (:func:`assign_to_ranks`).

The loss does not depend on the packing: ``reduce_loss`` divides by the whole step's totals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass
class BatchLayout:
    """Which samples each micro-batch holds, for the no-gradient forwards and for training."""

    forward: list[list[int]]  # micro-batches of the no-gradient forwards, consecutive, in rollout order
    steps: list[list[list[int]]]  # optimizer steps, each a list of training micro-batches

    @property
    def train(self) -> list[list[int]]:
        """The training micro-batches of every step, one after another."""
        return [micro_batch for step in self.steps for micro_batch in step]

    def step_ranges(self) -> list[range]:
        """For each optimizer step, the positions of its micro-batches in :attr:`train`."""
        ranges, first = [], 0
        for step in self.steps:
            ranges.append(range(first, first + len(step)))
            first += len(step)
        return ranges


def fixed_layout(count: int, micro_batch_size: int, global_batch_size: int) -> BatchLayout:
    """``micro_batch_size`` consecutive samples per micro-batch, ``global_batch_size // micro_batch_size``
    micro-batches (at least one) per optimizer step; the no-gradient forwards use the same micro-batches."""
    micro_batches = [list(range(i, min(i + micro_batch_size, count))) for i in range(0, count, micro_batch_size)]
    per_step = max(1, global_batch_size // micro_batch_size)
    steps = [micro_batches[i : i + per_step] for i in range(0, len(micro_batches), per_step)]
    return BatchLayout(forward=micro_batches, steps=steps)


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: micro-batches of at most ``budget`` tokens; a sample longer than the budget is
    alone in its micro-batch. Deterministic (ties are broken by position); indices ascend inside a micro-batch."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        target = next((b for b, load in enumerate(loads) if load + length <= budget), None)
        if target is None:
            bins.append([index])
            loads.append(length)
        else:
            bins[target].append(index)
            loads[target] += length
    return [sorted(b) for b in bins]


def pack_consecutive(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive samples up to ``budget`` tokens per micro-batch (rollout order kept); a sample longer than
    the budget is alone in its micro-batch."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    batches: list[list[int]] = []
    load = 0
    for index, length in enumerate(lengths):
        if batches and load + length <= budget:
            batches[-1].append(index)
            load += length
        else:
            batches.append([index])
            load = length
    return batches


def split_to_multiple(batches: list[list[int]], lengths: Sequence[int], multiple: int) -> list[list[int]]:
    """``batches`` (lists of sample positions) with the largest ones cut in two until their count is a multiple of
    ``multiple``: the one of most tokens among those of two samples or more, at the sample that best halves its
    tokens, its two parts in its place (consecutive micro-batches stay consecutive and in order). A smaller
    micro-batch never exceeds the budget its parent met. ValueError if there are fewer samples than the count
    needs (a step of fewer samples than ranks)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    batches = [list(b) for b in batches]
    target = -(-max(len(batches), 1) // multiple) * multiple
    while len(batches) < target:
        splittable = [i for i, b in enumerate(batches) if len(b) > 1]
        if not splittable:
            samples = sum(len(b) for b in batches)
            raise ValueError(f"{samples} sample(s) cannot make {target} micro-batches (a multiple of {multiple})")
        index = max(splittable, key=lambda i: (sum(lengths[j] for j in batches[i]), -i))
        batch = batches[index]
        tokens = [lengths[j] for j in batch]
        total, running, cut = sum(tokens), 0, 1
        best = None
        for position in range(1, len(batch)):
            running += tokens[position - 1]
            imbalance = abs(total - 2 * running)
            if best is None or imbalance < best:
                best, cut = imbalance, position
        batches[index : index + 1] = [batch[:cut], batch[cut:]]
    return batches


def dynamic_layout(
    lengths: Sequence[int], global_batch_size: int, max_tokens: int, forward_max_tokens: int, multiple: int = 1
) -> BatchLayout:
    """Optimizer steps of ``global_batch_size`` consecutive samples (the last may be short), each packed by
    :func:`pack_by_tokens`; the no-gradient forwards by :func:`pack_consecutive`; with ``multiple`` > 1 each
    step's micro-batches and the forwards' made a multiple of it in number (:func:`split_to_multiple`)."""
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
    steps = []
    for first in range(0, len(lengths), global_batch_size):
        part = lengths[first : first + global_batch_size]
        packed = split_to_multiple(pack_by_tokens(part, max_tokens), part, multiple)
        steps.append([[first + i for i in micro_batch] for micro_batch in packed])
    forward = split_to_multiple(pack_consecutive(lengths, forward_max_tokens), lengths, multiple)
    return BatchLayout(forward=forward, steps=steps)


def over_budget(lengths: Sequence[int], budget: int) -> list[int]:
    """Positions of the samples longer than ``budget`` tokens (each trains in a micro-batch of its own)."""
    return [i for i, length in enumerate(lengths) if length > budget]


def assign_to_ranks(token_counts: Sequence[int], ranks: int, *, equal_counts: bool = False) -> list[int]:
    """The rank of each micro-batch: largest first, each to the rank with the fewest tokens so far (ties: the
    lowest rank). Every rank computes the same answer from the same counts. ``equal_counts``: every rank gets
    ``len(token_counts) / ranks`` micro-batches (a rank that has its share takes no more), for ranks that must
    run as many forwards as each other; the count must then be a multiple of ``ranks``."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if equal_counts and len(token_counts) % ranks:
        raise ValueError(f"{len(token_counts)} micro-batches cannot be shared equally by {ranks} ranks")
    share = len(token_counts) // ranks if equal_counts else len(token_counts)
    loads, taken = [0] * ranks, [0] * ranks
    owner = [0] * len(token_counts)
    for index in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        rank = min((r for r in range(ranks) if taken[r] < share), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += token_counts[index]
        taken[rank] += 1
    return owner


def regroup(
    values: Sequence[Sequence[T]], source: Sequence[Sequence[int]], target: Sequence[Sequence[int]]
) -> list[list[T]]:
    """Per-sample items moved from one layout to another: ``values[b][r]`` belongs to sample ``source[b][r]``;
    the result's ``[b][r]`` is the item of sample ``target[b][r]``."""
    by_sample: dict[int, T] = {}
    for batch_values, batch_samples in zip(values, source, strict=True):
        for value, sample in zip(batch_values, batch_samples, strict=True):
            by_sample[sample] = value
    return [[by_sample[sample] for sample in batch] for batch in target]
