"""Held-out evaluation through the router: generate for every prompt, score, average."""

from __future__ import annotations

import asyncio
import statistics

import aiohttp

from vime.data.prompt import render_prompt
from vime.data.source import PromptDataset
from vime.rollout.generate import SamplingParams, generate
from vime.rollout.rewards import RewardFn
from vime.sample import Sample


async def evaluate_dataset(dataset: PromptDataset, *, tokenizer, router_url: str, reward: RewardFn, args,
                           params: SamplingParams, n_samples: int, apply_chat_template: bool,
                           timeout: float, concurrency: int = 64) -> dict[str, float]:
    limit = asyncio.Semaphore(concurrency)

    async def one(session, record, index) -> Sample:
        tokens = render_prompt(tokenizer, record.prompt, apply_chat_template=apply_chat_template)
        sample = Sample(index=index, prompt_index=record.index, prompt=record.prompt, label=record.label,
                        tokens=list(tokens), metadata=dict(record.metadata), session_id=f"eval-{record.index}-{index}")
        async with limit:
            await generate(session, router_url, sample, params, timeout=timeout)
        sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        sample.reward = float(await reward(args, sample))
        return sample

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        samples = await asyncio.gather(*(one(session, record, i) for record in dataset.records
                                         for i in range(n_samples)))
    return {"reward": statistics.fmean(s.reward for s in samples),
            "response_length": statistics.fmean(s.response_length for s in samples),
            "samples": float(len(samples))}
