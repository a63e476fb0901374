"""``--update-weight-mode auto``: each version published full or as a delta, whichever synchronised faster.

A delta saves bytes (written by the trainer, read by every engine) and costs time to encode and to apply;
which one wins depends on the model, how much one step changes it, and the file system between the trainer
and the engines (a local disk: full versions are hard links and cost almost nothing; a network volume: every
byte is an upload and a download). So the choice is measured, not configured: the cost of a synchronisation
is what the driver waits for, the trainer's publication plus the slowest engine's load (its own copy, the
pause, vLLM's reload), and auto publishes the mode whose recent syncs were faster.

- The first publication of a trainer process is full (nothing to encode against); the next one is a delta,
  so that both modes have a cost before any choice.
- The chosen mode's cost is smoothed (an exponential moving average), because one sync can be slowed by
  anything else running on the machine; the other mode's is its last try.
- The mode not chosen is tried again after ``probe_interval`` publications, or later when its last try was
  much slower: a try of a mode R times slower costs R - 1 syncs' worth, so tries are spaced to cost at most
  ``PROBE_BUDGET`` (10%) of the time in between. That way a change in its cost (later in training a step
  changes fewer bits, and deltas compress better) is seen without paying for it at every interval.
- The publisher's own rules still hold: a delta needs the parent this process published just before, an
  engine that does not hold it forces a full version, and a delta chain is at most
  ``--update-weight-full-interval`` - 1 long.
"""

from __future__ import annotations

import enum
import math


class PublishMode(enum.Enum):
    FULL = "full"
    DELTA = "delta"


# Weight of the newest sync in a mode's smoothed cost.
SMOOTHING = 0.5
# What tries of the slower mode may cost, as a fraction of the syncs between two tries.
PROBE_BUDGET = 0.1


class AutoModeChoice:
    """The driver's side of auto: which mode to ask for (:meth:`next_mode`), and what each sync cost
    (:meth:`record`, with the mode the publisher actually wrote)."""

    def __init__(self, probe_interval: int):
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        self.probe_interval = probe_interval
        self.cost: dict[PublishMode, float | None] = {PublishMode.FULL: None, PublishMode.DELTA: None}
        self.since_probe = 0  # publications since the mode not chosen was last tried

    def _cheaper(self) -> PublishMode | None:
        full, delta = self.cost[PublishMode.FULL], self.cost[PublishMode.DELTA]
        if full is None or delta is None:
            return None
        return PublishMode.FULL if full <= delta else PublishMode.DELTA

    def next_mode(self) -> PublishMode:
        if self.cost[PublishMode.DELTA] is None:  # a first publication is full whatever is asked; then a delta
            return PublishMode.DELTA
        cheaper = self._cheaper()
        if cheaper is None:
            return PublishMode.FULL
        if self.since_probe + 1 >= self.probe_gap():
            return PublishMode.DELTA if cheaper is PublishMode.FULL else PublishMode.FULL
        return cheaper

    def publish_arguments(self, force_full: bool) -> tuple[str, bool]:
        """(mode, force_full) for WeightPublisher.publish: auto always publishes through delta mode, which keeps
        the files it published to encode the next version against, and a full version is a forced one (also
        when the caller already forces it: an engine without the parent)."""
        return PublishMode.DELTA.value, force_full or self.next_mode() is PublishMode.FULL

    def probe_gap(self) -> int:
        """Publications in the chosen mode between two tries of the other: ``probe_interval``, or more when the
        other mode was R times slower, so that its tries cost at most PROBE_BUDGET of the syncs in between."""
        cheaper = self._cheaper()
        if cheaper is None:
            return self.probe_interval
        other = PublishMode.DELTA if cheaper is PublishMode.FULL else PublishMode.FULL
        chosen_cost, other_cost = self.cost[cheaper], self.cost[other]
        if chosen_cost <= 0:
            return self.probe_interval
        extra = other_cost / chosen_cost - 1.0  # what one try costs beyond a sync in the chosen mode, in syncs
        return max(self.probe_interval, math.ceil(extra / PROBE_BUDGET))

    def record(self, mode: PublishMode, seconds: float) -> None:
        """One synchronisation in ``mode`` (what was written, which may differ from what was asked) took
        ``seconds`` (publication + the slowest engine's load). The chosen mode's cost is smoothed over its
        syncs; a try of the other mode replaces that mode's cost, which was older than any other."""
        chosen = self._cheaper()
        if chosen is None or mode is not chosen:
            self.cost[mode] = seconds
            self.since_probe = 0
        else:
            before = self.cost[mode]
            self.cost[mode] = SMOOTHING * seconds + (1 - SMOOTHING) * before
            self.since_probe += 1

    def describe(self) -> str:
        """The smoothed costs, for the sync's metrics and the log."""
        return ", ".join(
            f"{mode.value} {cost:.3f}s" if cost is not None else f"{mode.value} not measured"
            for mode, cost in self.cost.items()
        )
