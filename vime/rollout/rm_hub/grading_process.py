"""A process of its own for the rewards that run sympy (``math``, ``deepscaler``).

Symbolic comparison is CPU-bound and, on unlucky input, slow. Run inline it would stall the rollout
worker's event loop (lease heartbeats, every other group's requests); run in a thread it could not be
time-limited, because math-verify limits itself with ``signal.alarm``, which only a main thread may set.
One spawned process per rollout worker (or driver) does the grading on its main thread instead. It is
started on first use, and replaced if it dies; the sample whose grading killed it fails with a clear
error. The process carries the parent's environment, so the run's sweep of its processes finds it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from vime.errors import MemberDied


class RewardProcessDied(MemberDied, RuntimeError):
    """The reward process died while grading a sample (out of memory, a crash in a native library)."""


_lock = threading.Lock()
_executor: concurrent.futures.ProcessPoolExecutor | None = None


def _pool() -> concurrent.futures.ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            # spawn, not fork: the parent has threads (Ray, aiohttp, the publish thread) that fork would copy
            # in whatever state they were in.
            _executor = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
        return _executor


def _forget(broken: concurrent.futures.ProcessPoolExecutor) -> None:
    global _executor
    with _lock:
        if _executor is broken:
            _executor = None
    broken.shutdown(wait=False, cancel_futures=True)


async def run_in_reward_process(function, *args: Any) -> Any:
    """``function(*args)`` (a module-level function, picklable arguments) in the reward process."""
    pool = _pool()
    try:
        return await asyncio.wrap_future(pool.submit(function, *args))
    except BrokenProcessPool as error:
        _forget(pool)
        raise RewardProcessDied(f"the reward process died grading a sample ({error}); it is started again") from None


def shutdown() -> None:
    """Stop the reward process (tests; a worker's process exit stops it too)."""
    global _executor
    with _lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=True, cancel_futures=True)
