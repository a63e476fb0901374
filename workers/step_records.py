"""The record of each training step the driver writes (metrics.jsonl and the progress line, vime/train.py):
the trainer's metrics beside the step's throughput and the queue's state after it."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any


class StepRecords:
    """Each step's record, and the rollout throughput over the last few steps it reports (accepted tokens
    arrive in bursts). Created as training starts: the first window begins there.

    It also says when the controller was restarted since the last record (a new incarnation answers: Ray restarted
    a crashed one, or one that ended itself after a failed write of the queue, recovery/volume_failure.py) and
    counts the restarts in ``controller_restarts``."""

    def __init__(self, controller, *, incarnation: str, say: Callable[[str], None] = print):
        """``incarnation``: the controller's that answered first (RunProcesses.controller_incarnation)."""
        import ray

        self.controller = controller
        self.say = say
        stats = ray.get(controller.stats.remote())
        self.window = collections.deque([(time.monotonic(), stats.accepted_response_tokens)], maxlen=6)
        self.incarnation = incarnation
        self.controller_restarts = 0

    def record(self, step: int, version: int, metrics: dict[str, Any], *, regenerated: int) -> dict[str, Any]:
        """The record of ``step`` (trained into weight ``version``) with the queue's statistics now;
        ``regenerated``: the groups passed over as too stale, whose prompts run again."""
        import ray

        window = self.window
        stats = ray.get(self.controller.stats.remote())
        if stats.incarnation != self.incarnation:
            self.incarnation = stats.incarnation
            self.controller_restarts += 1
            self.say(
                f"the controller was restarted (by step {step}): a new incarnation ({stats.incarnation}) recovered "
                "the queue from its journal, and the prompts of the old one's leases run again"
            )
        now = time.monotonic()
        step_seconds = now - window[-1][0]
        window.append((now, stats.accepted_response_tokens))
        return {
            "kind": "train",
            "step": step,
            "weight_version": version,
            **metrics,
            "rollout_tokens_per_s": (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]),
            "train_tokens_per_s": metrics["train_tokens"] / max(metrics["train_seconds"], 1e-9),
            "queue_depth": stats.queue_depth,
            "queue_pending": stats.pending,
            "queue_leased": stats.leased,
            "queue_filtered": stats.rejected,
            "step_seconds": step_seconds,
            "queue_reclaimed_bytes": stats.reclaimed_bytes,
            "groups_regenerated": regenerated,
            "queue_failed": stats.failed,
            "controller_restarts": self.controller_restarts,
        }
