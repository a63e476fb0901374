"""What the engine manager does with an engine that fails (workers/engine_manager.py; docs/elastic.md).

A join, restart, catch-up, registration or probe that fails, a health check that gives up on a
serving engine or a weight update that fails on it: vime's own engines are restarted at the current
version (up to ``--rollout-engine-restart-budget`` times each), external ones are quarantined and probed
with back-off until they generate again, and one whose node left, or whose budget is spent, is dropped.
When every engine is gone and none is on its way, the run cannot make progress: :class:`EnginesLost`.

:class:`EngineRecovery`, which the manager owns, decides all of this; it acts on the engines only through
:class:`EngineControls` (the manager implements it), so that the policy stays apart from the mechanics
of starting, routing and stopping engines. The per-engine state it keeps (quarantine probe schedule,
restarts, why an engine was dropped) lives on each engine's :class:`Member`, which `vime engines list` shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from vime.workers.engine_members import (
    QUARANTINE_FIRST_PROBE_SECONDS,
    QUARANTINE_MAX_PROBE_SECONDS,
    EnginesLost,
    EngineState,
    Member,
)
from vime.workers.failure_reasons import progress_reason


class EngineControls(Protocol):
    """What :class:`EngineRecovery` may read of the run's engines and do to them (EngineManager)."""

    members: list[Member]  # every engine of the run, read only
    version: int  # the current weight version
    ending: bool  # the run is ending: nothing is restarted or probed any more
    say: Callable[[str], None]  # a line for the operator
    record: Callable[[dict], None]  # an event for the run's records

    def note(self, text: str) -> None:
        """One short line for the progress line (take_notes)."""

    def node_alive(self, node_id: str | None) -> bool: ...

    def withdraw(self, m: Member) -> None:
        """Take a serving engine out of the weight updates, the health checks and the router."""

    def relaunch(self, m: Member) -> None:
        """Start ``m`` again at the current version (its process, or its actor too when that died)."""

    def probe(self, m: Member) -> None:
        """Check whether a quarantined ``m`` generates again (collected at a later poll)."""

    def finish_request(self, m: Member, ok: bool, message: str) -> None:
        """Answer the `vime engines` request ``m`` is carrying out."""

    def dispose(self, m: Member) -> None:
        """Stop ``m``'s process (vime's own) or detach from it (external), and end its actor."""


class EngineRecovery:
    """Restart, quarantine or drop an engine that failed; raise :class:`EnginesLost` when none is left."""

    def __init__(self, engines: EngineControls, *, restart_budget: int, log_dir: str):
        self.engines = engines
        self.restart_budget = restart_budget  # --rollout-engine-restart-budget, per engine
        self.log_dir = log_dir  # named in EnginesLost: the engines' logs say why they failed

    def failed(self, m: Member, what: str, reason: str) -> None:
        """A join / restart / catch-up / registration / quarantine probe or rejoin of ``m`` failed."""
        if m.state == EngineState.QUARANTINED:  # still broken: probed again later, never given up on
            m.last_error = f"{what} failed: {reason}"
            m.probe_backoff = min(2 * m.probe_backoff, QUARANTINE_MAX_PROBE_SECONDS)
            m.next_probe = time.monotonic() + m.probe_backoff
            return
        m.last_error = f"{what} failed: {reason}"
        if m.request or not m.owned:
            self.give_up(m, m.last_error)
        else:
            self._restart(m, m.last_error)

    def lose(self, m: Member, reason: str, *, restart: bool = True) -> None:
        """A serving engine is gone or cannot serve (health checks and probes, a failed call, its node).
        vime's own engines are restarted (within their budget); an external one is quarantined until
        it passes a probe again; one whose node left is dropped."""
        self.engines.withdraw(m)
        self.engines.record({"kind": "engine", "event": "down", "engine": m.name, "url": m.url, "reason": reason})
        m.last_error = reason
        if not restart:
            self.give_up(m, reason)
        elif m.owned:
            self._restart(m, reason)
        else:
            self._quarantine(m, reason)

    def node_left(self, node_id: str) -> None:
        """Drop every engine of a node that left the cluster: nothing of it can come back."""
        for m in self.engines.members:
            if m.node_id == node_id and m.state in (
                EngineState.STARTING,
                EngineState.SERVING,
                EngineState.SYNCING,
                EngineState.RESTARTING,
                EngineState.QUARANTINED,
            ):
                m.pending = None  # whatever it was doing will never answer
                if m.state == EngineState.SERVING:
                    self.lose(m, f"its node {node_id[:12]} left the cluster", restart=False)
                else:
                    self.give_up(m, f"its node {node_id[:12]} left the cluster")

    def _quarantine(self, m: Member, reason: str) -> None:
        """Keep an external engine that cannot serve out of the router and of weight updates; probe it
        with back-off (QUARANTINE_*_PROBE_SECONDS) and let it rejoin when a probe passes."""
        if self.engines.ending:
            self.give_up(m, f"{reason}; not probed again: the run is ending")
            return
        m.state, m.since, m.pending = EngineState.QUARANTINED, time.monotonic(), None
        m.probe_backoff = QUARANTINE_FIRST_PROBE_SECONDS
        m.next_probe = time.monotonic() + m.probe_backoff
        self.engines.say(
            f"{m.name} ({m.url}) quarantined: {reason}; it stays out of the router until a generation probe "
            "passes (probed with back-off)"
        )
        self.engines.record(
            {"kind": "engine", "event": "quarantined", "engine": m.name, "url": m.url, "reason": reason}
        )
        self.engines.note(f"{m.name} quarantined: {progress_reason(reason)}")

    def probe_due(self, now: float) -> None:
        """Probe every quarantined engine whose back-off has passed and that is not being probed."""
        for m in self.engines.members:
            if m.state == EngineState.QUARANTINED and m.pending is None and now >= m.next_probe:
                self.engines.probe(m)

    def _restart(self, m: Member, reason: str) -> None:
        budget = self.restart_budget
        if self.engines.ending:
            self.give_up(m, f"{reason}; not restarted: the run is ending")
            return
        if not self.engines.node_alive(m.node_id):
            self.give_up(m, f"{reason}; its node left the cluster")
            return
        if m.restarts >= budget:
            self.give_up(
                m, f"{reason}; restart budget used up ({m.restarts}/{budget}, --rollout-engine-restart-budget)"
            )
            return
        m.restarts += 1
        m.state, m.since = EngineState.RESTARTING, time.monotonic()
        self.engines.note(f"{m.name} restarting: {progress_reason(reason)}")
        self.engines.say(
            f"{m.name} ({m.url}) is down: {reason}; restarting it ({m.restarts}/{budget}) at weight version "
            f"{self.engines.version}"
        )
        self.engines.relaunch(m)

    def give_up(self, m: Member, reason: str) -> None:
        """Drop ``m`` for good (LOST): out of routing if it served, its request refused, its process ended."""
        if m.state in (EngineState.SERVING, EngineState.SYNCING):
            self.engines.withdraw(m)
        m.state, m.last_error = EngineState.LOST, reason
        self.engines.say(f"{m.name} ({m.url or m.spec.external_url}) dropped: {reason}")
        if not m.request:  # a refused `vime engines add` never served: its answer says why
            self.engines.note(f"{m.name} dropped: {progress_reason(reason)}")
        self.engines.record({"kind": "engine", "event": "lost", "engine": m.name, "url": m.url, "reason": reason})
        if m.request:
            self.engines.finish_request(m, False, reason)
        self.engines.dispose(m)

    def check_progress_possible(self) -> None:
        """Raise :class:`EnginesLost` when every engine was dropped (not merely removed on request)."""
        members = self.engines.members
        if not members or any(m.state not in (EngineState.REMOVED, EngineState.LOST) for m in members):
            return
        if all(m.state == EngineState.REMOVED for m in members):
            return
        why = "; ".join(f"{m.name} ({m.origin}): {m.last_error}" for m in members if m.state == EngineState.LOST)
        raise EnginesLost(
            f"every rollout engine is gone and none is starting, so no sample can be generated: {why}. "
            f"Engine logs are in {self.log_dir}"
        )
