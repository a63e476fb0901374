"""Megatron-style learning-rate schedule, shared by the torch and Megatron backends.

The formulas are those of Megatron-LM's ``OptimizerParamScheduler`` (``--lr-decay-style``,
``--lr-warmup-*``, ``--lr-decay-iters``, ``--min-lr``), counted in *iterations*: one iteration is
one optimizer step. A rollout of ``--rollout-batch-size`` x ``--n-samples-per-prompt`` samples makes
one step per ``--global-batch-size`` samples, so a run makes ``--num-rollout`` x that many steps (PPO's
actor fewer, by its ``--num-critic-only-steps`` rollouts). Step ``i`` (0-based: ``i`` steps were taken
before it) trains at :meth:`LRSchedule.lr_at` ``(i)``, as Megatron's first step trains at ``get_lr(0)``.

Each trained role (the actor, PPO's critic) owns one schedule and one step count; the backends keep
the count in their training state so that a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import dataclasses
import math

from vime.config.base import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The learning rate of each optimizer step of one role."""

    lr: float
    """Peak learning rate (``--lr``): reached at the end of the warmup, held by 'constant'."""
    min_lr: float = 0.0
    """Floor of the decay, and the rate after ``decay_iters`` steps (``--min-lr``)."""
    warmup_init: float = 0.0
    """Rate of the first warmup step (``--lr-warmup-init``)."""
    warmup_iters: float = 0.0
    """Steps of linear warmup; fractional with ``--lr-warmup-fraction`` (a fraction of ``decay_iters``)."""
    decay_iters: int | None = None
    """Steps over which the rate decays to ``min_lr``; unused by 'constant' (``--lr-decay-iters``)."""
    decay_style: str = "constant"
    wsd_decay_iters: int | None = None
    """WSD: the final steps of ``decay_iters`` that anneal (``--lr-wsd-decay-iters``)."""
    wsd_decay_style: str = "exponential"

    def __post_init__(self):
        # Internal invariants: user errors were reported against their flag or YAML field before this.
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style {self.decay_style!r}: expected one of {DECAY_STYLES}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"wsd_decay_style {self.wsd_decay_style!r}: expected one of {WSD_DECAY_STYLES}")
        if not 0 <= self.min_lr <= self.lr or not 0 <= self.warmup_init <= self.lr:
            raise ValueError(f"need 0 <= min_lr, warmup_init <= lr (got {self.min_lr}, {self.warmup_init}, {self.lr})")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters {self.warmup_iters} < 0")
        if self.decay_style != "constant" or self.decay_iters is not None:
            if self.decay_iters is None or not self.warmup_iters < self.decay_iters:
                raise ValueError(f"need warmup_iters < decay_iters (got {self.warmup_iters}, {self.decay_iters})")
        if self.decay_style == "WSD" and not (self.wsd_decay_iters and 0 < self.wsd_decay_iters <= self.decay_iters):
            raise ValueError(f"WSD needs 0 < wsd_decay_iters <= decay_iters (got {self.wsd_decay_iters})")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.lr - self.warmup_init) * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if step > self.decay_iters:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_iters, 1) / max(step, 1)))
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable until the last wsd_decay_iters steps of the decay, then anneal
            anneal_start = self.decay_iters - self.wsd_decay_iters
            coeff = (
                1.0
                if step <= anneal_start
                else _anneal(self.wsd_decay_style, (step - anneal_start) / self.wsd_decay_iters)
            )
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def for_role(self, role, source: str | None = None) -> LRSchedule:
        """This schedule for a role of ``--megatron-config-path`` (a ``vime.config.roles.RoleOverrides``).

        The role's ``lr`` scales the whole shape (``min_lr`` and ``lr_warmup_init`` proportionally);
        its ``min_lr``, ``lr_warmup_iters`` and ``lr_decay_style`` replace the command line's. Errors
        name the YAML field."""
        from vime.config.roles import FLAG

        def fail(key: str, message: str):
            raise ConfigError(FLAG, f"{source or '<yaml>'}: {role.field(key)}: {message}")

        lr = float(role.get("lr", self.lr))
        scale = lr / self.lr
        min_lr = float(role.get("min_lr", self.min_lr * scale))
        style = role.get("lr_decay_style", self.decay_style)
        warmup = role.get("lr_warmup_iters", self.warmup_iters)
        if min_lr > lr:
            fail("min_lr" if "min_lr" in role.values else "lr", f"min_lr {min_lr:g} is above the role's lr {lr:g}")
        if style == "WSD" and self.wsd_decay_iters is None:
            fail("lr_decay_style", "WSD needs --lr-wsd-decay-iters on the command line")
        if (style != "constant" or self.decay_iters is not None) and not warmup < (self.decay_iters or 0):
            fail(
                "lr_warmup_iters" if "lr_warmup_iters" in role.values else "lr_decay_style",
                f"the warmup ({warmup:g} steps) must end before the decay does (--lr-decay-iters {self.decay_iters})",
            )
        return dataclasses.replace(
            self, lr=lr, min_lr=min_lr, warmup_init=self.warmup_init * scale, warmup_iters=warmup, decay_style=style
        )


def _anneal(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5**ratio - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


def optimizer_steps_per_rollout(
    samples: int, global_batch_size: int, micro_batch_size: int, dynamic: bool = False
) -> int:
    """Optimizer steps of a full rollout, as the backends take them: one per ``global_batch_size //
    micro_batch_size`` micro-batches (at least one); with token budgets (``dynamic``), one per global batch."""
    if dynamic:
        return math.ceil(samples / global_batch_size)
    micro_batches = math.ceil(samples / micro_batch_size)
    return math.ceil(micro_batches / max(1, global_batch_size // micro_batch_size))


def schedule_from_flags(train, steps_per_rollout: int) -> LRSchedule:
    """The command line's schedule (``train``: a ``TrainConfig`` that passed ``validate()``).

    ``--lr-decay-iters`` defaults to the run's optimizer steps, ``--num-rollout`` x ``steps_per_rollout``
    (Megatron's default is ``--train-iters``); errors that need that number name the flag here."""
    decay_iters = train.lr_decay_iters
    default = decay_iters is None
    if default:
        decay_iters = train.num_rollout * steps_per_rollout
    warmup = train.lr_warmup_iters if train.lr_warmup_fraction is None else train.lr_warmup_fraction * decay_iters
    if not warmup < decay_iters:
        raise ConfigError(
            "--lr-warmup-iters",
            f"{warmup:g} warmup steps do not end before the decay does: "
            f"{decay_iters} steps ("
            + (
                f"--num-rollout {train.num_rollout} x {steps_per_rollout} optimizer steps per "
                "rollout, the default of --lr-decay-iters)"
                if default
                else "--lr-decay-iters)"
            ),
        )
    if train.lr_decay_style == "WSD" and train.lr_wsd_decay_iters > decay_iters:
        raise ConfigError(
            "--lr-wsd-decay-iters",
            f"{train.lr_wsd_decay_iters} is more than the {decay_iters} decay steps (--lr-decay-iters)",
        )
    return LRSchedule(
        lr=train.lr,
        min_lr=train.min_lr,
        warmup_init=train.lr_warmup_init,
        warmup_iters=warmup,
        decay_iters=decay_iters,
        decay_style=train.lr_decay_style,
        wsd_decay_iters=train.lr_wsd_decay_iters,
        wsd_decay_style=train.lr_wsd_decay_style,
    )


def lr_schedule_from_settings(settings) -> LRSchedule:
    """The command line's schedule for a ``vime train`` run (``vime.config.TrainSettings``); also builds
    each role's of ``--megatron-config-path``, so that every schedule error surfaces at start-up."""
    s = settings
    steps = optimizer_steps_per_rollout(
        s.rollout.rollout_batch_size * s.rollout.n_samples_per_prompt,
        s.global_batch_size,
        s.train.micro_batch_size,
        dynamic=s.train.use_dynamic_batch_size,
    )
    schedule = schedule_from_flags(s.train, steps)
    if s.algorithm.megatron_config_path is not None:
        roles = s.algorithm.role_config()
        for role in roles.roles.values():
            schedule.for_role(role, roles.source)
    return schedule
