"""The reference framework's logging hooks: --custom-rollout-log-function-path and
--custom-eval-rollout-log-function-path.

Each is called with the reference's arguments, and answers in two ways: the numbers it puts in the dict
it is given are logged at the step, under the names it gives them (the record's :data:`USER_METRICS`
field; the trackers name them as given, vime/tracking.py), and returning True says it logged the data
itself, so that vime's own metrics of that data stay out of the trackers (the record's :data:`UNTRACKED`
field lists them). metrics.jsonl always keeps every field: the progress line, the reward curve and
`vime queue inspect` read it.

The rollout hook runs in the trainer's rank 0, where a step's samples are decoded, before it trains on them;
the evaluation hook runs in the driver after each evaluation. What either raises stops the run naming the
flag (a user error: a trainer restart would meet it again).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from vime.errors import UserError
from vime.runtime.plugins import load_hook

ROLLOUT_LOG_FLAG = "--custom-rollout-log-function-path"
EVAL_LOG_FLAG = "--custom-eval-rollout-log-function-path"
USER_METRICS = "user_metrics"  # a record's field: the hook's numbers, by the names it gave them
UNTRACKED = "untracked"  # a record's field: the names of its fields the trackers leave out


class LogHookError(UserError, RuntimeError):
    """A logging hook raised or answered with something vime cannot log; the message names the flag."""


class LogHook:
    """One logging hook, loaded (its call checked) from ``path``; ``args`` is what it receives as ``args``."""

    def __init__(self, flag: str, path: str, args: argparse.Namespace | None):
        self.flag, self.path = flag, path
        self.args = args if args is not None else argparse.Namespace()
        self.function = load_hook(flag, path)

    def _numbers(self, extra: dict[str, Any]) -> dict[str, float]:
        """The hook's metrics as floats (a one-element tensor or numpy value too); anything else is refused,
        naming the metric."""
        numbers = {}
        for name, value in extra.items():
            if not isinstance(name, str):
                raise LogHookError(f"{self.flag} {self.path}: metric name {name!r} is not a string")
            try:
                if isinstance(value, str | bytes):  # float() would read "3" as a number
                    raise TypeError(value)
                numbers[name] = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError, RuntimeError):
                raise LogHookError(
                    f"{self.flag} {self.path}: metric {name!r} is a {type(value).__name__}, not a number"
                ) from None
        return numbers

    def _run(self, arguments: tuple) -> bool:
        """Call the hook; whether it says it logged the data itself."""
        try:
            answer = self.function(*arguments)
        except Exception as error:  # the user's function: said with the flag, the run stops
            raise LogHookError(f"{self.flag} {self.path}: raised {type(error).__name__}: {error}") from error
        return bool(answer)


class RolloutLogHook(LogHook):
    """--custom-rollout-log-function-path: ``log(rollout_id, args, samples, rollout_extra_metrics,
    rollout_time)``."""

    def __init__(self, path: str, args: argparse.Namespace | None):
        super().__init__(ROLLOUT_LOG_FLAG, path, args)

    def __call__(self, rollout_id: int, samples: list, rollout_time: float) -> tuple[dict[str, float], bool]:
        extra: dict[str, Any] = {}
        logged_itself = self._run((rollout_id, self.args, samples, extra, rollout_time))
        return self._numbers(extra), logged_itself


class EvalLogHook(LogHook):
    """--custom-eval-rollout-log-function-path: ``log(rollout_id, args, data, extra_metrics)``, ``data`` by
    held-out set name."""

    def __init__(self, path: str, args: argparse.Namespace | None):
        super().__init__(EVAL_LOG_FLAG, path, args)

    def __call__(self, rollout_id: int, data: dict[str, dict[str, Any]]) -> tuple[dict[str, float], bool]:
        extra: dict[str, Any] = {}
        logged_itself = self._run((rollout_id, self.args, data, extra))
        return self._numbers(extra), logged_itself


def hook_fields(extra: dict[str, float], logged_itself: bool, defaults: Iterable[str]) -> dict[str, Any]:
    """The fields a record gains from a hook's answer: its numbers, and (when it logged the data itself) the
    names of the record's ``defaults`` that the trackers leave out."""
    fields: dict[str, Any] = {USER_METRICS: extra}
    if logged_itself:
        fields[UNTRACKED] = sorted(defaults)
    return fields
