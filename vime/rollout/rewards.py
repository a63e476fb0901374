"""Scoring samples: built-in ``--rm-type`` rules, the ``remote_rm`` HTTP reward server, or the user's
``--custom-rm-path`` function; each sample's reward ends up one float in ``sample.reward``.

Which reward applies to a sample, first match wins (the reference framework's order):
``--custom-rm-path``, then the sample's ``metadata["rm_type"]``, then ``--rm-type``. A reward that is a
dict (a remote server's JSON object, DAPO's ``{"score", "acc", "pred"}``) gives its ``--reward-key``
entry (DAPO's ``score`` by default). With ``--group-rm`` a custom function is called once per group,
``rm(args, samples) -> list``. The rules themselves live in vime.rollout.rm_hub.
"""

from __future__ import annotations

import asyncio
import dataclasses
import numbers

from vime.config.rewards import REMOTE_RM, rm_type_problem
from vime.errors import UserError
from vime.rollout.rm_hub.grading_process import run_in_reward_process
from vime.rollout.rm_hub.rules import score_with_rule, split_rm_type
from vime.runtime.plugins import call_maybe_async, load_function
from vime.sample import Sample


class RewardError(UserError, ValueError):
    """A reward function, server or per-sample rm_type gave something vime cannot use as a reward."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardOptions:
    """The reward flags (the ``Rollout and reward`` section of vime.config.framework)."""

    rm_type: str | None = None
    custom_rm_path: str | None = None
    reward_key: str | None = None
    group_rm: bool = False
    rm_url: str | None = None
    rm_timeout: float = 120.0
    rm_max_attempts: int = 10

    @classmethod
    def from_config(cls, rollout) -> RewardOptions:
        """From a RolloutConfig (or anything with its reward fields)."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)})


class Reward:
    """The run's reward: ``await reward.score_group(args, samples)`` sets every ``sample.reward``."""

    def __init__(self, options: RewardOptions):
        self.options = options
        self.custom = (
            load_function(options.custom_rm_path, "--custom-rm-path", min_params=2) if options.custom_rm_path else None
        )
        if self.custom is None and options.rm_type is not None and (problem := rm_type_problem(options.rm_type)):
            raise RewardError(f"--rm-type: {problem}")
        self.remote = None
        if options.rm_url:
            from vime.rollout.rm_hub.remote import RemoteRewardModel  # aiohttp: not for `vime train --help`

            self.remote = RemoteRewardModel(
                options.rm_url, timeout=options.rm_timeout, max_attempts=options.rm_max_attempts
            )

    async def score_group(self, args, samples: list[Sample]) -> None:
        """Score one group (all samples of one prompt)."""
        if self.custom is not None and self.options.group_rm:
            values = await call_maybe_async(self.custom, args, samples)
            if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
                raise RewardError(
                    f"--custom-rm-path {self.options.custom_rm_path} with --group-rm returned "
                    f"{type(values).__name__}; expected a list of one reward per sample"
                )
            if len(values) != len(samples):
                raise RewardError(
                    f"--custom-rm-path {self.options.custom_rm_path} with --group-rm returned {len(values)} "
                    f"rewards for a group of {len(samples)} samples"
                )
            rm_types = [None] * len(samples)
        else:
            rm_types = [self.rm_type_of(sample) for sample in samples]
            values = await asyncio.gather(*(self.raw_reward(args, s, t) for s, t in zip(samples, rm_types)))
        for sample, value, rm_type in zip(samples, values, rm_types):
            sample.reward = self._scalar(value, rm_type, sample)

    async def score(self, args, sample: Sample) -> float:
        """One sample's reward (a group of one; ``--group-rm`` functions get a list of one)."""
        await self.score_group(args, [sample])
        return sample.reward

    def rm_type_of(self, sample: Sample) -> str | None:
        """The rule that scores ``sample`` (None: the custom function)."""
        if self.custom is not None:
            return None
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        if metadata.get("rm_type"):
            name = metadata["rm_type"]
            if problem := rm_type_problem(name):
                raise RewardError(
                    f'metadata["rm_type"] of sample {sample.index} of group {sample.group_index}: {problem}'
                )
            return name.strip()
        if self.options.rm_type is None:
            raise RewardError(
                f"sample {sample.index} of group {sample.group_index} has no reward: no --rm-type, "
                'no --custom-rm-path and no metadata["rm_type"]'
            )
        return self.options.rm_type.strip()

    async def raw_reward(self, args, sample: Sample, rm_type: str | None):
        """The raw result (a number or a dict) of the reward that ``rm_type`` names (None: the custom one)."""
        if rm_type is None:
            return await call_maybe_async(self.custom, args, sample)
        if rm_type == REMOTE_RM:
            if self.remote is None:
                raise RewardError(
                    f"sample {sample.index} of group {sample.group_index} is scored by remote_rm, which needs --rm-url"
                )
            return await self.remote.score(sample)
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        rule, _ = split_rm_type(rm_type)
        if rule.symbolic:
            return await run_in_reward_process(score_with_rule, rm_type, sample.response, sample.label, metadata)
        return score_with_rule(rm_type, sample.response, sample.label, metadata)

    def _scalar(self, value, rm_type: str | None, sample: Sample) -> float:
        """The float reward of one raw result: a number, or a dict's --reward-key entry."""
        who = f"--custom-rm-path {self.options.custom_rm_path}" if rm_type is None else f"reward {rm_type!r}"
        if isinstance(value, dict):
            key = self.options.reward_key
            if key is None and rm_type is not None and rm_type != REMOTE_RM:
                key = split_rm_type(rm_type)[0].dict_reward_key
            if key is None:
                raise RewardError(
                    f"{who} returned a dict (keys {sorted(value)}) for sample {sample.index} of group "
                    f"{sample.group_index}; name the key that is the reward with --reward-key"
                )
            if key not in value:
                raise RewardError(
                    f"--reward-key {key!r}: the dict {who} returned has no such key (keys {sorted(value)})"
                )
            value = value[key]
            if isinstance(value, bool):  # e.g. DAPO's "acc": a 0/1 reward
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"{who} returned {value!r} ({type(value).__name__}) for sample {sample.index} of group "
                f"{sample.group_index}; expected a number, or a dict with --reward-key"
            )
        return float(value)


def resolve_reward(options: RewardOptions) -> Reward:
    """The run's reward; a bad --custom-rm-path or --rm-type fails here (at start-up) naming the flag."""
    return Reward(options)


def reward_by_source(samples: list[Sample]) -> dict[str, float]:
    """``{"reward_mean/<source>": mean reward}`` per ``sample.source_name`` (for per-source metrics)."""
    totals: dict[str, list[float]] = {}
    for sample in samples:
        if sample.reward is not None:
            totals.setdefault(sample.source_name, []).append(float(sample.reward))
    return {f"reward_mean/{name}": sum(values) / len(values) for name, values in sorted(totals.items())}
