"""The engine manager's side of `vime engines` (workers/engine_manager.py; docs/elastic.md).

The run's named registry actor (workers/engine_registry.py) is the way in: `vime engines add` and
`remove` leave requests there. :class:`EngineRequestDesk`, which the manager owns, holds the registry's
handle: it takes the requests at the manager's polls, hands each to the manager's public
:meth:`~vime.workers.engine_manager.EngineManager.add_external` or
:meth:`~vime.workers.engine_manager.EngineManager.remove` (an external engine joins at the current weight
version; a removed one is unregistered and drained, its requests in flight returned to the queue),
answers the request when the manager says how it ended, and publishes the manager's snapshot that
`vime engines list` reads. It knows nothing of the engines beyond what :class:`RequestedEngines` offers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from vime.engines.external import engine_url
from vime.workers.engine_members import Member
from vime.workers.engine_registry import REGISTRY_NAME, EngineOp, EngineRegistry
from vime.workers.failure_reasons import error_reason

SNAPSHOT_SECONDS = 1.0
REQUEST_POLL_SECONDS = 0.5


class RequestedEngines(Protocol):
    """What the desk asks of the engines (EngineManager implements it). ``add_external`` and ``remove``
    start what was asked and raise ValueError, whose text is the answer, when it cannot be done."""

    def add_external(self, url: str, *, request: str) -> Member: ...

    def remove(self, target: str, *, request: str) -> None: ...

    def snapshot(self) -> dict: ...


class EngineRequestDesk:
    """`vime engines` requests in, answers and the engine snapshot out, through the run's registry actor."""

    def __init__(self, engines: RequestedEngines, *, say: Callable[[str], None]):
        self.engines, self.say = engines, say
        self.registry: Any = None  # the registry actor's handle, once opened (None: no `vime engines`)
        self.taken_at = 0.0  # time.monotonic() when requests were last taken (REQUEST_POLL_SECONDS apart)
        self._published_at = 0.0

    def open(self, namespace: str | None = None) -> None:
        """Create the run's named registry actor (the way in for `vime engines`)."""
        import ray

        self.registry = (
            ray.remote(num_cpus=0)(EngineRegistry)
            .options(name=REGISTRY_NAME, namespace=namespace, lifetime=None)
            .remote()
        )
        ray.get(self.registry.engines.remote(), timeout=60)
        self.publish(force=True)

    def take_due(self, now: float) -> None:
        """Take and carry out the pending requests, at most every REQUEST_POLL_SECONDS."""
        if self.registry is None or now - self.taken_at < REQUEST_POLL_SECONDS:
            return
        self.taken_at = now
        self._take()

    def _take(self) -> None:
        import ray

        try:
            requests = ray.get(self.registry.take.remote(), timeout=10)
        except Exception as error:  # noqa: BLE001 - the registry is not vital to the run
            self.say(f"engine registry unreachable: {error_reason(error)}")
            return
        for request in requests:
            try:
                self._carry_out(request)
            except Exception as error:  # noqa: BLE001 - a bad request fails alone, never the run
                message = str(error) if isinstance(error, ValueError) else error_reason(error)
                self.registry.finish.remote(request["id"], False, message)

    def _carry_out(self, request: dict) -> None:
        """Start what ``request`` asks; it is answered when that ends (:meth:`finish`), or at once if refused."""
        op, target = EngineOp(request["op"]), request["target"]
        if op is EngineOp.ADD:
            self.engines.add_external(engine_url(target), request=request["id"])
        elif op is EngineOp.REMOVE:
            self.engines.remove(target, request=request["id"])

    def finish(self, m: Member, ok: bool, message: str) -> None:
        """Answer the request ``m`` is carrying out, if any; ``m`` carries none afterwards."""
        if self.registry is not None and m.request:
            self.registry.finish.remote(m.request, ok, message, {"engine": m.name, "url": m.url})
        m.request = None

    def publish(self, force: bool = False) -> None:
        """Publish the manager's snapshot for `vime engines list`, at most every SNAPSHOT_SECONDS."""
        now = time.monotonic()
        if self.registry is None or (not force and now - self._published_at < SNAPSHOT_SECONDS):
            return
        self._published_at = now
        self.registry.publish.remote(self.engines.snapshot())  # fire and forget: the registry never blocks
