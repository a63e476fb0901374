"""--rollout-group-requests: which samples one request of vLLM's n may generate, the flag's start-up checks and its
path to the rollout workers. The request itself against the real engine is in tests/e2e/test_engine.py
(test_a_group_request_gives_each_sample_its_own_choice), a whole run with it in tests/e2e/test_main_job.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.queue.rollout_queue import StoreOptions
from vime.rollout.generate import SamplingParams, generate_group
from vime.sample import Sample, Status
from workers.rollout_worker import RolloutWorkerSpec, fresh_samples_of_one_prompt

UNREACHABLE = "http://127.0.0.1:9"  # a request sent here fails: the test below must send none


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def fresh(n: int, prompt=(1, 2, 3)) -> list[Sample]:
    return [Sample(group_index=0, index=i, tokens=list(prompt)) for i in range(n)]


def test_only_fresh_samples_of_one_prompt_go_in_one_request():
    assert fresh_samples_of_one_prompt(fresh(4))
    assert not fresh_samples_of_one_prompt(fresh(1))  # one sample: an ordinary request
    other_prompt = fresh(3) + fresh(1, prompt=(1, 2, 4))
    assert not fresh_samples_of_one_prompt(other_prompt)
    continued = fresh(3)
    continued[1].append_response_tokens([5, 6], [-0.1, -0.2], [0, 0])
    continued[1].status = Status.ABORTED  # a continuation (--partial-rollout) has a response of its own
    assert not fresh_samples_of_one_prompt(continued)


def test_a_group_with_no_room_left_is_truncated_without_a_request():
    samples = fresh(3)
    params = SamplingParams(max_new_tokens=8, max_context_len=3)  # the prompt fills the context

    async def ask():
        import aiohttp

        async with aiohttp.ClientSession() as http:
            return await generate_group(http, UNREACHABLE, samples, params, timeout=5)

    assert [s.status for s in asyncio.run(ask())] == [Status.TRUNCATED] * 3


def test_the_flag_reaches_the_rollout_workers(model_dir, tmp_path):
    store = StoreOptions(str(tmp_path / "queue"))
    for extra, grouped in (([], False), (["--rollout-group-requests"], True)):
        s = parse_train_args(base(model_dir, *extra))
        assert RolloutWorkerSpec.from_settings(s, index=0, router_url="http://r", store=store).group_requests is grouped


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--rollout-seed", "7"], "--rollout-seed"),
        (["--custom-generate-function-path", "tests.plugins.generate.echo"], "--custom-generate-function-path"),
        (["--use-rollout-routing-replay"], "--use-rollout-routing-replay"),
    ],
)
def test_what_needs_one_request_per_sample_is_refused_naming_both_flags(model_dir, extra, named):
    with pytest.raises(ConfigError, match=f"^--rollout-group-requests: cannot be combined with {named} "):
        parse_train_args(base(model_dir, "--rollout-group-requests", *extra))
