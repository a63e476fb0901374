"""``--rm-type remote_rm``: each sample is scored by the user's HTTP reward server at ``--rm-url``.

The request is the reference framework's: ``POST <rm-url>`` with the JSON body ``{"prompt", "response",
"label"}``; the answer is a JSON number, or a JSON object whose ``--reward-key`` is the reward. Each
attempt is bounded by ``--rm-timeout``; connection failures, timeouts, HTTP 429 and 5xx are tried again
(with exponential back-off) up to ``--rm-max-attempts`` tries in all, since scoring is idempotent. Any
other 4xx fails at once: the server refuses the request itself, and asking again would not change that.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_exponential

from vime.errors import UserError
from vime.sample import Sample


class RemoteRewardError(UserError, RuntimeError):
    """The reward server at --rm-url failed or answered something that is no reward."""

    def __init__(self, url: str, message: str):
        self.url, self.message = url, message
        super().__init__(f"--rm-url {url}: {message}")

    def __reduce__(self):  # crosses Ray actor boundaries
        return type(self), (self.url, self.message)


class _TryAgain(Exception):
    """An answer worth another attempt (429, 5xx); ``why`` says what it was."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _retryable(error: BaseException) -> bool:
    return isinstance(error, (_TryAgain, aiohttp.ClientConnectionError, asyncio.TimeoutError))


def _describe(error: BaseException | None, timeout: float) -> str:
    if isinstance(error, _TryAgain):
        return error.why
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer within --rm-timeout {timeout:g}s"
    return f"{type(error).__name__}: {error}"


class RemoteRewardModel:
    """The client of one reward server; ``await model.score(sample)`` is its raw JSON answer."""

    def __init__(self, url: str, *, timeout: float, max_attempts: int, backoff_seconds: float = 0.5):
        self.url, self.timeout, self.max_attempts = url, timeout, max_attempts
        self.backoff_seconds = backoff_seconds

    async def score(self, sample: Sample):
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_attempts),
            wait=wait_exponential(multiplier=self.backoff_seconds, max=30.0),
            retry=retry_if_exception(_retryable),
            reraise=False,
        )
        try:
            # One session per sample: the server may be slow (a model), the connection set-up is not what
            # costs, and no session outlives its event loop.
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
                async for attempt in retrying:
                    with attempt:
                        return await self._post(session, payload)
        except RetryError as error:
            last = error.last_attempt.exception()
            raise RemoteRewardError(
                self.url, f"failed after {self.max_attempts} attempt(s): {_describe(last, self.timeout)}"
            ) from None

    async def _post(self, session: aiohttp.ClientSession, payload: dict):
        async with session.post(self.url, json=payload) as response:
            body = await response.text()
            if response.status == 429 or response.status >= 500:
                raise _TryAgain(f"HTTP {response.status}: {body[:300]}")
            if response.status >= 400:
                raise RemoteRewardError(self.url, f"HTTP {response.status} (not retried): {body[:300]}")
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise RemoteRewardError(self.url, f"answered non-JSON: {body[:300]!r}") from None
