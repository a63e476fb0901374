"""The engine manager's side of `vime engines` (workers/engine_manager.py; docs/elastic.md).

The run's named registry actor (workers/engine_registry.py) is the way in: `vime engines add` and
`remove` leave requests there, which the manager takes at its polls, carries out (an external engine joins
at the current weight version; a removed one is unregistered and drained, its requests in flight returned
to the queue) and finishes with an answer; `vime engines list` reads the snapshot published there.
"""

from __future__ import annotations

import time

from vime.engines.external import engine_url
from vime.workers.engine_members import EngineState, Member
from vime.workers.engine_registry import REGISTRY_NAME, EngineRegistry
from vime.workers.failure_reasons import error_reason

SNAPSHOT_SECONDS = 1.0


class EngineRequests:
    """`vime engines` requests and the snapshot `vime engines list` reads, for
    :class:`~vime.workers.engine_manager.EngineManager`, which it is mixed into."""

    def open_registry(self, namespace: str | None = None) -> None:
        """Create the run's named registry actor (the way in for `vime engines`)."""
        import ray

        self.registry = (
            ray.remote(num_cpus=0)(EngineRegistry)
            .options(name=REGISTRY_NAME, namespace=namespace, lifetime=None)
            .remote()
        )
        ray.get(self.registry.engines.remote(), timeout=60)
        self._publish_snapshot(force=True)

    def _take_requests(self) -> None:
        import ray

        try:
            requests = ray.get(self.registry.take.remote(), timeout=10)
        except Exception as error:  # noqa: BLE001 - the registry is not vital to the run
            self.say(f"engine registry unreachable: {error_reason(error)}")
            return
        for request in requests:
            try:
                {"add": self._request_add, "remove": self._request_remove}[request["op"]](request)
            except Exception as error:  # noqa: BLE001 - a bad request fails alone, never the run
                message = str(error) if isinstance(error, ValueError) else error_reason(error)
                self.registry.finish.remote(request["id"], False, message)

    def _request_add(self, request: dict) -> None:
        url = engine_url(request["target"])
        if self.static_roles:
            raise ValueError(
                "this model runs prefill/decode engines behind a router that lists them from its "
                "command line: engines cannot join it while it runs"
            )
        if self.template.weight_transport != "disk":
            raise ValueError(
                "an external engine joins a running job with --update-weight-transport disk only "
                "(with nccl it would need vime's worker extension, which vime cannot check)"
            )
        taken = next(
            (m for m in self.members if m.url == url and m.state not in (EngineState.REMOVED, EngineState.LOST)), None
        )
        if taken is not None:
            raise ValueError(f"{url} is already {taken.name} of this run ({taken.state})")
        member = self._spawn(
            "added", external_url=url, request=request["id"], startup_timeout=self.template.http_timeout
        )
        self.say(f"vime engines add {url}: {member.name} loads weight version {self.version}")

    def _request_remove(self, request: dict) -> None:
        target = request["target"]
        url = target if target.startswith("engine-") else engine_url(target)
        member = next(
            (
                m
                for m in self.members
                if (m.url == url or m.name == url) and m.state in (EngineState.SERVING, EngineState.QUARANTINED)
            ),
            None,
        )
        if member is None:
            raise ValueError(f"no serving or quarantined engine {target} in this run (see `vime engines list`)")
        if member.state == EngineState.QUARANTINED:  # out of the router already, nothing in flight
            member.pending, member.request = None, request["id"]
            self._drained(member, 0)
            return
        if sum(m.state == EngineState.SERVING for m in self.members) == 1:
            raise ValueError(f"{member.name} is the only serving engine of the run; add another one first")
        self.group.remove(member.url)
        self.monitor.unwatch(member.url)
        if self.register_with_router:
            self.router.remove_worker(member.url)
        member.state, member.request = EngineState.DRAINING, request["id"]
        self._pend(member, member.actor.drain.remote(), "drain", self.group.call_timeout)
        self.say(f"vime engines remove {target}: {member.name} unregistered, draining its requests")

    def _drained(self, m: Member, aborted: int | None, error: str | None = None) -> None:
        m.state = EngineState.REMOVED
        self._dispose(m)
        what = (
            f"{aborted} request(s) in flight returned to the queue as continuations"
            if aborted is not None
            else f"draining failed ({error}); its groups return to the queue when their requests fail"
        )
        message = f"{m.name} ({m.url}) removed; {what}" + ("" if m.owned else "; the external engine keeps running")
        self.say(message)
        self.record({"kind": "engine", "event": "removed", "engine": m.name, "url": m.url, "aborted": aborted})
        if m.request:
            self._finish(m, True, message)

    def _finish(self, m: Member, ok: bool, message: str) -> None:
        if self.registry is not None and m.request:
            self.registry.finish.remote(m.request, ok, message, {"engine": m.name, "url": m.url})
        m.request = None

    def snapshot(self) -> dict:
        health = self.monitor.status()
        served = dict(zip(self.group.urls, self.group.versions))
        engines = []
        for m in self.members:
            if m.state == EngineState.SERVING and m.url in served:
                m.version = served[m.url]
            engines.append(m.describe(health.get(m.url or "", {})))
        return {"weight_version": self.version, "engines": engines}

    def _publish_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.registry is None or (not force and now - self._last["snapshot"] < SNAPSHOT_SECONDS):
            return
        self._last["snapshot"] = now
        self.registry.publish.remote(self.snapshot())  # fire and forget: the registry never blocks
