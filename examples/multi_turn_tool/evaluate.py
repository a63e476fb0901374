"""Evaluation with the same two-turn tool loop (``--eval-function-path``).

Called once per ``--eval-prompt-data`` set as ``generate_rollout(args, rollout_id, data_source,
evaluation=True)``; greedy decoding; returns the reference framework's ``RolloutFnEvalOutput``.
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tool_generate import generate
from tool_reward import reward

from vime.rollout.types import RolloutFnEvalOutput


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert evaluation, "this function only evaluates"
    samples = [s for group in data_source.get_samples(len(data_source)) for s in group]
    params = {"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": -1}

    async def run():
        return await asyncio.gather(*(generate(args, sample, params) for sample in samples))

    asyncio.run(run())
    for sample in samples:
        sample.reward = reward(args, sample)
    return RolloutFnEvalOutput(
        data={data_source.name: {"rewards": [s.reward for s in samples], "samples": samples}},
        metrics={"eval_turns": sum(s.metadata.get("turns", 0) for s in samples) / len(samples)},
    )
