"""Synchronous control-plane HTTP calls to engines and the router: always bounded, always named.

Every call has a timeout. Retries are bounded and happen only where repeating cannot make things
worse: the connection could not be made (nothing was sent) or dropped, or the server answered 5xx.
A read timeout is not retried: the server may still be working on the request, and repeating it
would only double the wait before the caller learns about the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import requests
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from vime.errors import UserError

DEFAULT_ATTEMPTS = 3


class EngineError(UserError, RuntimeError):
    """A call to a server failed; the message names the server and the call."""

    role = "engine"

    def __init__(self, url: str, message: str):
        self.url = url
        self.message = message
        super().__init__(f"{self.role} {url}: {message}")

    def __reduce__(self):  # errors cross Ray actor boundaries: keep them picklable
        return type(self), (self.url, self.message)


class _RetryableStatus(Exception):
    def __init__(self, response: requests.Response):
        self.response = response


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, _RetryableStatus):
        return True
    # ConnectTimeout is a ConnectionError (nothing was sent); ReadTimeout is not, and is not retried.
    return isinstance(exc, requests.ConnectionError)


def call(
    method: str,
    base_url: str,
    path: str,
    *,
    timeout: float,
    params: Mapping[str, Any] | None = None,
    json_body: Any = None,
    attempts: int = DEFAULT_ATTEMPTS,
    error_type: type[EngineError] = EngineError,
) -> requests.Response:
    """One HTTP call with a timeout per attempt; returns the 2xx response or raises ``error_type``.

    Worst case it takes about ``attempts * timeout`` plus a few seconds of back-off.
    """
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    base_url = base_url.rstrip("/")
    what = f"{method} {path}" + (f"?{urlencode(params)}" if params else "")

    def attempt() -> requests.Response:
        response = requests.request(method, base_url + path, params=params, json=json_body, timeout=timeout)
        if response.status_code >= 500:
            raise _RetryableStatus(response)
        return response

    retrying = Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        retry=retry_if_exception(_is_retryable),
        reraise=False,
    )
    try:
        response = retrying(attempt)
    except RetryError as exc:
        last = exc.last_attempt.exception()
        if isinstance(last, _RetryableStatus):
            raise error_type(base_url, _status_message(what, last.response, attempts)) from None
        raise error_type(base_url, f"{what} could not connect after {attempts} attempt(s): {last}") from last
    except requests.Timeout as exc:
        raise error_type(base_url, f"{what} timed out after {timeout:g}s") from exc
    except requests.RequestException as exc:
        raise error_type(base_url, f"{what} failed: {exc}") from exc
    if response.status_code >= 400:
        raise error_type(base_url, _status_message(what, response, 1))
    return response


def call_json(
    method: str,
    base_url: str,
    path: str,
    *,
    timeout: float,
    params: Mapping[str, Any] | None = None,
    json_body: Any = None,
    attempts: int = DEFAULT_ATTEMPTS,
    error_type: type[EngineError] = EngineError,
) -> Any:
    """Like :func:`call`, returning the decoded JSON body (None for an empty body)."""
    response = call(
        method,
        base_url,
        path,
        timeout=timeout,
        params=params,
        json_body=json_body,
        attempts=attempts,
        error_type=error_type,
    )
    if not response.content:
        return None
    try:
        return response.json()
    except json.JSONDecodeError as exc:
        what = f"{method} {path}"
        raise error_type(base_url.rstrip("/"), f"{what} returned non-JSON: {response.text[:300]!r}") from exc


def _status_message(what: str, response: requests.Response, attempts: int) -> str:
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    return f"{what} returned HTTP {response.status_code}{tries}: {response.text[:500]}"
