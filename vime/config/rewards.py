"""The names ``--rm-type`` (and a sample's ``metadata["rm_type"]``) accepts, and the reward flags' checks.

The names are declared here, at the bottom of the layers, so that start-up validation needs no component;
vime.rollout.rm_hub implements one rule per name (tests/unit/test_rewards.py checks that both agree).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from vime.config.base import require

RULE_REWARDS = ("math", "deepscaler", "dapo", "gpqa", "f1", "exact_match", "char_accuracy", "random")
REMOTE_RM = "remote_rm"
BOXED_PREFIX = "boxed_"  # boxed_<rule>: only the response's last \boxed{} answer is graded


def rm_type_problem(rm_type: Any) -> str | None:
    """Why ``rm_type`` names no reward of vime's (None: it names one)."""
    if not isinstance(rm_type, str) or not rm_type.strip():
        return f"{rm_type!r} is not a reward name"
    name = rm_type.strip()
    if name == REMOTE_RM:
        return None
    if name == BOXED_PREFIX + REMOTE_RM:
        return f"{name!r}: the boxed_ prefix applies to the rule-based rewards; remote_rm sends the whole response"
    if name.removeprefix(BOXED_PREFIX) in RULE_REWARDS:
        return None
    hint = " (ifbench needs the IFBench instruction checkers, which vime does not ship)" if "ifbench" in name else ""
    return (
        f"unknown reward {name!r}{hint}; choose one of {', '.join((*RULE_REWARDS, REMOTE_RM))}, "
        "or boxed_<rule> (e.g. boxed_math)"
    )


def check_reward_flags(rollout) -> None:
    """The reward flags of a RolloutConfig, each refused naming its flag."""
    if rollout.rm_type is not None:
        problem = rm_type_problem(rollout.rm_type)
        require(problem is None, "--rm-type", problem or "")
    require(
        rollout.rm_type != REMOTE_RM or rollout.rm_url is not None,
        "--rm-url",
        "is required with --rm-type remote_rm (the reward server's URL)",
    )
    if rollout.rm_url is not None:
        url = urlparse(rollout.rm_url)
        require(
            url.scheme in ("http", "https") and bool(url.netloc),
            "--rm-url",
            f"expected an http:// or https:// URL, got {rollout.rm_url!r}",
        )
    require(rollout.rm_timeout > 0, "--rm-timeout", "must be > 0")
    require(rollout.rm_max_attempts >= 1, "--rm-max-attempts", "must be >= 1")
    require(rollout.reward_key is None or bool(rollout.reward_key.strip()), "--reward-key", "must not be empty")
