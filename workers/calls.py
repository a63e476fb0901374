"""Waiting on calls that meet inside a collective (NCCL or gloo): when one participant fails the others
would wait for it forever, so the first failure is raised at once and the whole wait is bounded."""

from __future__ import annotations

import time


def wait_all(refs: list, timeout: float | None, what: str, *, error: type[Exception] = RuntimeError) -> list:
    """ray.get of ``refs`` in order; the first participant's error is raised as soon as it is known, and
    ``error`` names ``what`` did not finish within ``timeout`` seconds (None: no bound, for work whose
    length is the user's, like a training step)."""
    import ray

    pending = list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise error(f"{what}: {len(pending)} of {len(refs)} participant(s) did not finish in {timeout:.0f}s")
        ray.get(done)  # raises the participant's error
    return ray.get(refs)
