"""--rm-type remote_rm against a real HTTP reward server on 127.0.0.1: the request, dict answers with
--reward-key, retries of 5xx, no retry of 4xx, and the timeout."""

import asyncio

import pytest
from aiohttp import web

from vime.rollout.rewards import Reward, RewardOptions
from vime.rollout.rm_hub.remote import RemoteRewardError
from vime.sample import Sample


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/score"


def _run(handler, score, **options):
    """Start the server, score with it, stop it; returns (score's result, the requests the server saw)."""
    seen = []

    async def recording(request):
        seen.append(await request.json())
        return await handler(request, len(seen))

    async def main():
        runner, url = await _serve(recording)
        try:
            reward = Reward(RewardOptions(rm_type="remote_rm", rm_url=url, **options))
            return await score(reward)
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen


def _sample(response="4", label="4"):
    return Sample(index=0, group_index=1, prompt="2+2=", response=response, label=label)


def test_a_number_answer_is_the_reward_and_the_request_is_the_references():
    async def handler(request, n):
        body = await request.json()
        return web.json_response(1.0 if body["response"] == body["label"] else 0.0)

    rewards, seen = _run(handler, lambda r: asyncio.gather(r.score(None, _sample()), r.score(None, _sample("5"))))
    assert list(rewards) == [1.0, 0.0]
    assert seen[0] == {"prompt": "2+2=", "response": "4", "label": "4"}


def test_a_dict_answer_gives_its_reward_key():
    async def handler(request, n):
        return web.json_response({"score": 0.75, "details": "ok"})

    reward, _ = _run(handler, lambda r: r.score(None, _sample()), reward_key="score")
    assert reward == 0.75


def test_server_errors_are_retried_and_client_errors_are_not():
    async def flaky(request, n):
        return web.Response(status=503, text="warming up") if n < 3 else web.json_response(0.5)

    reward, seen = _run(flaky, lambda r: r.score(None, _sample()), rm_max_attempts=4)
    assert reward == 0.5 and len(seen) == 3

    async def refuses(request, n):
        return web.Response(status=422, text="no label field")

    with pytest.raises(RemoteRewardError, match=r"^--rm-url http://127\.0\.0\.1:\d+/score: HTTP 422 \(not retried\)"):
        _run(refuses, lambda r: r.score(None, _sample()), rm_max_attempts=4)

    async def always_down(request, n):
        return web.Response(status=500, text="boom")

    with pytest.raises(RemoteRewardError, match="failed after 2 attempt\\(s\\): HTTP 500: boom"):
        _run(always_down, lambda r: r.score(None, _sample()), rm_max_attempts=2)


def test_a_slow_server_times_out_with_the_flag_named():
    async def slow(request, n):
        await asyncio.sleep(5)
        return web.json_response(1.0)

    with pytest.raises(RemoteRewardError, match="failed after 1 attempt\\(s\\): no answer within --rm-timeout 0.3s"):
        _run(slow, lambda r: r.score(None, _sample()), rm_timeout=0.3, rm_max_attempts=1)


def test_an_answer_that_is_no_reward_is_refused():
    async def text(request, n):
        return web.json_response("great")

    from vime.rollout.rewards import RewardError

    with pytest.raises(RewardError, match="reward 'remote_rm' returned 'great'"):
        _run(text, lambda r: r.score(None, _sample()))
