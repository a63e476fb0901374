"""The built-in rewards (the reference framework's ``rollout/rm_hub``, by the same import path).

``--rm-type`` and a sample's ``metadata["rm_type"]`` name one of :data:`RULES`, ``remote_rm`` or
``boxed_<rule>``; vime.rollout.rewards applies them. A ``--custom-rm-path`` function that wants a
built-in rule's opinion awaits :func:`async_rm` (one sample) or :func:`batched_async_rm` (a list), as
with the reference. Both return the rule's raw result (a number, or DAPO's / a server's dict) and never
call ``--custom-rm-path`` themselves, so a custom function can wrap them without calling itself.
"""

from __future__ import annotations

import asyncio
import dataclasses

from vime.rollout.rm_hub.answers import last_boxed_answer
from vime.rollout.rm_hub.math_equivalence import math_answers_match
from vime.rollout.rm_hub.rules import RULES, score_with_rule
from vime.sample import Sample

__all__ = ["RULES", "async_rm", "batched_async_rm", "last_boxed_answer", "math_answers_match", "score_with_rule"]


def _builtin_reward(args):
    from vime.rollout.rewards import Reward, RewardOptions

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(RewardOptions) if hasattr(args, f.name)}
    return Reward(RewardOptions(**{**fields, "custom_rm_path": None, "group_rm": False}))


async def async_rm(args, sample: Sample, **kwargs):
    """The built-in reward of one sample (its ``metadata["rm_type"]``, else ``args.rm_type``), raw."""
    reward = _builtin_reward(args)
    return await reward.raw_reward(args, sample, reward.rm_type_of(sample))


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list:
    """:func:`async_rm` of each sample, in order."""
    reward = _builtin_reward(args)
    return list(await asyncio.gather(*(reward.raw_reward(args, s, reward.rm_type_of(s)) for s in samples)))
