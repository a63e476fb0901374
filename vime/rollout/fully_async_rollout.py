"""``--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async``, as the usage
guide enables distributed fully-async rollout: in vime that *is* the built-in rollout (long-lived rollout
workers leasing prompts from the queue), so the flag with this path selects it, exactly as leaving the flag
out does (vime.config.framework.BUILTIN_ROLLOUT_PATHS). The function below exists so that the path imports
and is checked like any other; vime never calls it.
"""

from __future__ import annotations

from vime.errors import UserError


class BuiltinRolloutCalled(UserError, RuntimeError):
    """Someone called the stand-in of the built-in rollout as a function."""


def generate_rollout_fully_async(args, rollout_id, data_source, evaluation=False):
    """Stands for vime's built-in fully-async rollout, which runs inside the rollout workers."""
    raise BuiltinRolloutCalled(
        "vime.rollout.fully_async_rollout.generate_rollout_fully_async stands for vime's built-in rollout, "
        "which runs inside its rollout workers; `vime train --rollout-function-path` with this path selects it. "
        "It cannot be called as a function."
    )
