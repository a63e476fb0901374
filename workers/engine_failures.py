"""What the engine manager does with an engine that fails (workers/engine_manager.py; docs/elastic.md).

A join, restart, catch-up, registration, drain or probe that fails, a health check that gives up on a
serving engine or a weight update that fails on it: vime's own engines are restarted at the current
version (up to ``--rollout-engine-restart-budget`` times each), external ones are quarantined and probed
with back-off until they generate again, and one whose node left, or whose budget is spent, is dropped.
When every engine is gone and none is on its way, the run cannot make progress: :class:`EnginesLost`.
"""

from __future__ import annotations

import time

from vime.engines.http import EngineError
from vime.workers.engine_members import (
    JOIN_SLACK_SECONDS,
    QUARANTINE_FIRST_PROBE_SECONDS,
    QUARANTINE_MAX_PROBE_SECONDS,
    EnginesLost,
    EngineState,
    Member,
)
from vime.workers.failure_reasons import actor_alive, error_reason, progress_reason


class EngineFailures:
    """The failure handling of :class:`~vime.workers.engine_manager.EngineManager`, which it is mixed into
    (its members, engine group, health monitor, router and weight version)."""

    def _failed(self, m: Member, what: str, reason: str) -> None:
        """A join / restart / catch-up / registration / drain / quarantine probe or rejoin failed."""
        if what == "drain":
            self._drained(m, None, reason)
            return
        if m.state == EngineState.QUARANTINED:  # still broken: probed again later, never given up on
            m.last_error = f"{what} failed: {reason}"
            m.probe_backoff = min(2 * m.probe_backoff, QUARANTINE_MAX_PROBE_SECONDS)
            m.next_probe = time.monotonic() + m.probe_backoff
            return
        m.last_error = f"{what} failed: {reason}"
        if m.request or not m.owned:
            self._give_up(m, m.last_error)
        else:
            self._restart(m, m.last_error)

    def _lose(self, m: Member, reason: str, *, restart: bool = True) -> None:
        """A serving engine is gone or cannot serve (health checks and probes, a failed call, its node).
        vime's own engines are restarted (within their budget); an external one is quarantined until
        it passes a probe again; one whose node left is dropped."""
        self.group.remove(m.url)
        self.monitor.unwatch(m.url)
        self._unregister_quietly(m.url)
        self.record({"kind": "engine", "event": "down", "engine": m.name, "url": m.url, "reason": reason})
        m.last_error = reason
        if not restart:
            self._give_up(m, reason)
        elif m.owned:
            self._restart(m, reason)
        else:
            self._quarantine(m, reason)

    def _quarantine(self, m: Member, reason: str) -> None:
        """Keep an external engine that cannot serve out of the router and of weight updates; probe it
        with back-off (QUARANTINE_*_PROBE_SECONDS) and let it rejoin when a probe passes."""
        if self.ending:
            self._give_up(m, f"{reason}; not probed again: the run is ending")
            return
        m.state, m.since, m.pending = EngineState.QUARANTINED, time.monotonic(), None
        m.probe_backoff = QUARANTINE_FIRST_PROBE_SECONDS
        m.next_probe = time.monotonic() + m.probe_backoff
        self.say(
            f"{m.name} ({m.url}) quarantined: {reason}; it stays out of the router until a generation probe "
            "passes (probed with back-off)"
        )
        self.record({"kind": "engine", "event": "quarantined", "engine": m.name, "url": m.url, "reason": reason})
        self._note(f"{m.name} quarantined: {progress_reason(reason)}")

    def _probe_quarantined(self, now: float) -> None:
        for m in self.members:
            if m.state == EngineState.QUARANTINED and m.pending is None and now >= m.next_probe:
                self._pend(m, m.actor.probe.remote(), "probe", self.template.http_timeout + 30)

    def _restart(self, m: Member, reason: str) -> None:
        budget = self.config.rollout_engine_restart_budget
        if self.ending:
            self._give_up(m, f"{reason}; not restarted: the run is ending")
            return
        if not self.node_alive(m.node_id):
            self._give_up(m, f"{reason}; its node left the cluster")
            return
        if m.restarts >= budget:
            self._give_up(
                m, f"{reason}; restart budget used up ({m.restarts}/{budget}, --rollout-engine-restart-budget)"
            )
            return
        m.restarts += 1
        m.state, m.since = EngineState.RESTARTING, time.monotonic()
        self._note(f"{m.name} restarting: {progress_reason(reason)}")
        self.say(
            f"{m.name} ({m.url}) is down: {reason}; restarting it ({m.restarts}/{budget}) at weight version "
            f"{self.version}"
        )
        if actor_alive(m.actor):
            self._pend(
                m,
                m.actor.restart.remote(self.template.weight_dir, self._join_version),
                "restart",
                m.spec.startup_timeout + JOIN_SLACK_SECONDS,
            )
        else:  # the actor died (or hangs) with its process: a new one on the same node
            import ray

            ray.kill(m.actor)
            self._create_actor(m)

    def _give_up(self, m: Member, reason: str) -> None:
        if m.state in (EngineState.SERVING, EngineState.SYNCING):
            self.group.remove(m.url)
            self.monitor.unwatch(m.url)
            self._unregister_quietly(m.url)
        m.state, m.last_error = EngineState.LOST, reason
        self.say(f"{m.name} ({m.url or m.spec.external_url}) dropped: {reason}")
        if not m.request:  # a refused `vime engines add` never served: its answer says why
            self._note(f"{m.name} dropped: {progress_reason(reason)}")
        self.record({"kind": "engine", "event": "lost", "engine": m.name, "url": m.url, "reason": reason})
        if m.request:
            self._finish(m, False, reason)
        self._dispose(m)

    def _dispose(self, m: Member) -> None:
        """Stop vime's own process (detach from an external one), end the actor; never blocks."""
        import ray

        try:
            ray.wait([m.actor.stop.remote()], timeout=30)  # a dead actor's call fails at once
        finally:
            ray.kill(m.actor)

    def _on_call_failure(self, url: str, error: BaseException) -> None:
        """A weight update or pause failed on one engine (EngineGroup has taken it out already)."""
        member = self._serving(url)
        if member is not None:
            self._lose(member, f"a call failed: {error_reason(error)}")

    def _unregister_quietly(self, url: str | None) -> None:
        member = next((m for m in self.members if m.url == url), None)
        if member is not None and member.worker_type != "regular":
            return  # never registered (an encoder), or listed on the PD router's command line for good
        if url and self.register_with_router:
            try:
                self.router.remove_worker(url)
            except EngineError:
                pass  # the router checks health too: a dead engine leaves its rotation anyway

    def _check_progress_possible(self) -> None:
        if not self.members or any(m.state not in (EngineState.REMOVED, EngineState.LOST) for m in self.members):
            return
        if all(m.state == EngineState.REMOVED for m in self.members):
            return
        why = "; ".join(f"{m.name} ({m.origin}): {m.last_error}" for m in self.members if m.state == EngineState.LOST)
        raise EnginesLost(
            f"every rollout engine is gone and none is starting, so no sample can be generated: {why}. "
            f"Engine logs are in {self.template.log_dir}"
        )
