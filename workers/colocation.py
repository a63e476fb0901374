"""Colocated memory (--colocate): the engines and the trainer share the GPUs and take turns with them.

One step, in this order (docs/real-models.md):

1. the rollout's groups are accepted (the engines generated them; the trainer is offloaded);
2. the engines sleep (--offload-rollout; vLLM's sleep mode) and the trainer reloads (--offload-train);
3. the trainer trains;
4. the weight update: each engine wakes its weights, loads the new version, then wakes its KV cache
   (``EngineActor._awake_after``), so weights, KV cache and the trainer's state are never all held;
5. the trainer offloads, and the engines generate the next rollout.

While the engines sleep their health checks count neither way (a sleeping engine does not answer a
generation probe until it wakes): the sleep is one long "update" for the health monitor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    sleep_level: int = 0  # vLLM sleep level of the engines while the trainer trains; 0: they do not sleep
    offload_train: bool = False

    @classmethod
    def from_settings(cls, s) -> OffloadPlan:
        return cls(sleep_level=s.rollout_sleep_level, offload_train=s.cluster.offloads_train)

    @property
    def active(self) -> bool:
        return bool(self.sleep_level) or self.offload_train


class ColocatedMemory:
    """The driver's side of the turns. ``trainer`` is the trainer group (``run(method, ...)``),
    ``engines`` the serving EngineGroup (or None), ``health`` a context-manager factory whose window
    makes health checks count neither way (EngineManager.updating), or None."""

    def __init__(self, plan: OffloadPlan, *, trainer: Any, engines: Any, health=None, timeout: float = 3600.0):
        self.plan, self.trainer, self.engines, self.health = plan, trainer, engines, health
        self.timeout = timeout
        self._asleep: contextlib.ExitStack | None = None

    @classmethod
    def for_run(cls, s, serving, trainer, *, say: Callable[[str], None]) -> ColocatedMemory:
        """The engines' and the trainer's turns of a ``vime train`` run (``serving``: its ModelServing); says
        what they are when there are any."""
        plan = OffloadPlan.from_settings(s)
        if plan.active:
            say(
                f"colocated memory: the engines sleep (level {plan.sleep_level}) while the trainer trains, "
                f"the trainer offloads while they generate"
                if plan.sleep_level and plan.offload_train
                else f"colocated memory: sleeping engines {bool(plan.sleep_level)}, offloaded trainer "
                f"{plan.offload_train}"
            )
        manager = serving.engine_manager
        return cls(plan, trainer=trainer, engines=serving.engines, health=manager.updating if manager else None)

    def before_training(self) -> None:
        """The rollout is complete: the engines sleep, the trainer takes its memory back."""
        if self.plan.sleep_level and self.engines is not None and len(self.engines):
            stack = contextlib.ExitStack()
            if self.health is not None:
                stack.enter_context(self.health())
            self._asleep = stack
            try:
                self.engines.sleep(self.plan.sleep_level)
            except BaseException:
                self._wake_window()
                raise
        if self.plan.offload_train:
            self.trainer.reload_memory(timeout=self.timeout)

    def after_weight_update(self) -> None:
        """The engines serve the new version (the update woke them): the trainer releases its memory."""
        self._wake_window()
        if self.plan.offload_train:
            self.trainer.offload_memory(timeout=self.timeout)

    def _wake_window(self) -> None:
        if self._asleep is not None:
            stack, self._asleep = self._asleep, None
            stack.close()
