"""What the user sees: one progress line per rollout, metrics.jsonl, and the reward curve."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: str, *, stream=sys.stdout):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self.stream = stream
        self.started = time.time()
        self.tracker = None  # vime.tracking.RunTracker with --use-wandb / --use-tensorboard

    def attach(self, tracker) -> None:
        """From now on every record also goes to ``tracker`` (vime.tracking.RunTracker; None: no tracker)."""
        self.tracker = tracker

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time() - self.started, 3), **record}
        self._file.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.write(record)

    def progress(self, m: dict[str, Any], num_rollout: int) -> None:
        line = (
            f"step {int(m['step']):>4}/{num_rollout} | v{int(m['weight_version'])} | "
            f"reward {m['reward_mean']:.3f} | resp_len {m['response_length_mean']:.1f} | "
            f"staleness {m['staleness_mean']:.2f}/{int(m['staleness_max'])} | "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s | train {m['train_tokens_per_s']:.0f} tok/s | "
            f"queue {int(m['queue_depth'])}"
        )
        if m.get("engines_total") and m.get("engines_serving") != m["engines_total"]:
            line += f" | engines {m['engines_serving']}/{m['engines_total']}"
        if m.get("rollout_engine_errors"):
            line += f" | {m['rollout_engine_errors']} engine error(s), groups requeued"
        for fault in m.get("engine_faults") or []:
            line += f" | {fault}"
        if m.get("queue_failed"):
            line += f" | failed {m['queue_failed']}"
        print(line, file=self.stream, flush=True)

    def say(self, message: str) -> None:
        print(f"[vime] {message}", file=self.stream, flush=True)

    def close(self) -> None:
        """The trackers, then metrics.jsonl. A tracker that fails to close is said, not raised: the run's
        teardown goes on (its processes still have to stop), and metrics.jsonl has every record."""
        try:
            if self.tracker is not None:
                self.tracker, tracker = None, self.tracker
                tracker.close()
        except Exception as error:  # noqa: BLE001 - said: whatever the library raises (wandb: its connection)
            self.say(f"the experiment trackers did not close cleanly: {type(error).__name__}: {error}")
        finally:
            self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_rewards(metrics_path: str, out_png: str) -> str:
    """Reward per step (and held-out reward where evaluated) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["reward_mean"]) for r in records if r.get("kind") == "train"]
    evals = [(r["step"], r["eval_reward"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="rollout reward (mean)", alpha=0.8)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out reward")
    ax.set_xlabel("step (weight version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
