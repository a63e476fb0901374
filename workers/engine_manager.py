"""Which engines serve a run, while it runs: start, join, health, restart, drain, elastic nodes.

The driver owns one ``EngineManager`` and calls :meth:`EngineManager.poll` between its own steps
(it never blocks: everything slow runs in engine actors and is collected later). The manager keeps
one :class:`Member` per engine and the :class:`~vime.workers.engines.EngineGroup` of those that
serve (what weight synchronisation updates). docs/elastic.md describes the behaviour; in short:

- **joining** (engines started at launch, on a node that joins the Ray cluster, restarted, or
  external ones attached with ``vime engines add``): the engine loads the *current* weight
  version, reads its label back, and only then is registered with the router; a version published
  meanwhile is loaded before registration. For a new node, the driver starts that node's rollout
  worker once its first engine serves (the ``ready`` :class:`NodeEvent`).
- **health**: a monitor thread (workers/health.py) checks every serving engine (``/health`` and a
  real generation probe, vime/engines/probe.py); a failing one is unregistered from the router at
  once; here it is restarted at the current version (engines vime started, up to
  ``--rollout-engine-restart-budget`` times each), quarantined (external engines: probed with
  back-off, back at the current version once a probe passes) or dropped (a lost node, an exhausted
  budget). A weight update, or the probe that ends it, failing on an engine counts the same.
- **removing** (``vime engines remove``): unregister, abort its requests in flight (their groups
  return to the queue as continuations), then stop it (vime's own) or detach from it (external).
- **nodes**: every ``NODE_POLL_SECONDS`` the alive Ray nodes are listed; a node with the
  ``--rollout-elastic-resource`` resource that hosts no engine of this run gets engines
  (NodeAffinitySchedulingStrategy), or, with ``--no-rollout-elastic-node-engines``, its ``ready`` event
  at once (a rollout worker only); a node that disappears takes its engines and its rollout
  worker with it (``lost`` event).

When no engine serves or is on its way any more although the run had some, :meth:`poll` raises
:class:`EnginesLost` naming why each one went: the job cannot make progress.

Who does what: the manager keeps the members and does the mechanics (start, join, register, withdraw,
relaunch, probe, drain, stop). Its ``recovery`` (workers/engine_failures.py, EngineRecovery) decides what
becomes of an engine that fails and acts through the EngineControls the manager implements; its
``request_desk`` (workers/engine_requests.py, EngineRequestDesk) holds the `vime engines` registry actor,
hands requests to :meth:`add_external` / :meth:`remove` and publishes :meth:`snapshot`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vime.config.elastic import ElasticConfig
from vime.engines.external import engine_url
from vime.engines.http import EngineError
from vime.engines.router import RouterClient
from vime.workers.engine_failures import EngineRecovery
from vime.workers.engine_members import (
    JOIN_SLACK_SECONDS,
    EngineState,
    EngineTemplate,
    EngineVariant,
    Member,
    NodeEvent,
    role_refusal,
)
from vime.workers.engine_nodes import NodeWatch
from vime.workers.engine_requests import EngineRequestDesk
from vime.workers.engines import EngineActor, EngineGroup
from vime.workers.failure_reasons import actor_alive, error_reason
from vime.workers.health import HealthMonitor

NODE_POLL_SECONDS = 2.0


class EngineManager:
    """One run's engines (this module's docstring): what fails is decided by its :class:`EngineRecovery`,
    `vime engines` requests come through its :class:`EngineRequestDesk`."""

    def __init__(
        self,
        *,
        template: EngineTemplate,
        config: ElasticConfig,
        router: RouterClient,
        say: Callable[[str], None] = print,
        record: Callable[[dict], None] = lambda r: None,
        register_with_router: bool = True,
        external_router: bool = False,
        static_roles: bool = False,
        actor_class: type = EngineActor,
    ):
        self.template, self.config, self.router = template, config, router
        self.external_router = external_router  # --vllm-router-ip: PD engines may be listed there already
        # vime started this model's prefill/decode/encoder engines: its router learns the PD ones from its
        # command line (they keep their port across restarts) and never routes to encoders.
        self.static_roles = static_roles
        self.actor_class = actor_class
        self.say, self.record = say, record
        self.register_with_router = register_with_router
        self.members: list[Member] = []
        self.group = EngineGroup(
            [], [], on_failure=self._on_call_failure, call_timeout=max(600.0, 10 * template.http_timeout)
        )
        self.monitor = HealthMonitor(
            interval=config.rollout_health_check_interval,
            timeout=config.rollout_health_check_timeout,
            failures=config.rollout_health_check_failures,
            on_dead=lambda url, _reason: self._unregister_quietly(url),
        )
        self.version = 0
        self.node_watch = NodeWatch(
            config.rollout_elastic_resource, template.tensor_parallel_size, config.rollout_elastic_node_engines
        )
        self.events: list[NodeEvent] = []
        self.notes: list[str] = []  # engine faults since the driver last asked (take_notes)
        self._next_index = 0
        self._nodes_ready: set[str] = set()
        self.ending = False  # the run is ending: lost engines are not restarted any more
        self._nodes_listed_at = 0.0  # time.monotonic() of the last node scan (NODE_POLL_SECONDS apart)
        self._remote = None
        self.recovery = EngineRecovery(
            self, restart_budget=config.rollout_engine_restart_budget, log_dir=template.log_dir
        )
        self.request_desk = EngineRequestDesk(self, say=say)

    # ================================================================== at start-up (blocking)
    def start_owned(self, count: int, variants: list[EngineVariant] | None = None) -> None:
        """Start ``count`` engines (vime's own), wait until each serves version 0, register them.
        ``variants`` (one per engine) replaces the template's vLLM flags and size engine by engine."""
        self.spawn_owned(count, variants)
        self.wait_started()

    def spawn_owned(self, count: int, variants: list[EngineVariant] | None = None) -> None:
        """Start ``count`` engines without waiting (:meth:`wait_started` waits): the engines of
        several models start at the same time."""
        if variants is not None and len(variants) != count:
            raise ValueError(f"{count} engine(s) but {len(variants)} variant(s)")
        for i in range(count):
            self._spawn("start", variant=variants[i] if variants else None)

    def wait_started(self) -> None:
        """Wait until every engine started at launch serves, and register them."""
        starting = [m for m in self.members if m.state == EngineState.STARTING and m.pending is not None]
        self._wait_joined(starting, self.template.startup_timeout + JOIN_SLACK_SECONDS)

    def attach_external(self, addresses: list[str]) -> None:
        """Use engines started elsewhere (--rollout-external-engine-addrs): read their /server_info,
        load version 0 (--hf-checkpoint) into them, register the regular ones with the router."""
        members = [self._spawn("external", external_url=engine_url(a)) for a in addresses]
        self._wait_joined(members, self.template.startup_timeout + JOIN_SLACK_SECONDS)

    def _wait_joined(self, members: list[Member], timeout: float) -> None:
        import ray

        refs = [m.pending for m in members]
        done, late = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if late:
            slow = [m for m in members if m.pending in late]
            raise EngineError(
                slow[0].spec.external_url or slow[0].name,
                f"not serving after {timeout:.0f}s (log: {slow[0].spec.log_path})",
            )
        for m in members:
            info = ray.get(m.pending)  # raises the engine's own error (with its log tail)
            m.pending = None
            self._joined(m, info)
            if m.state not in (EngineState.SERVING, EngineState.SYNCING):
                raise EngineError(m.url or m.name, m.last_error)

    # ================================================================== the driver's poll
    def open_registry(self, namespace: str | None = None) -> None:
        """Create the run's named registry actor (the way in for `vime engines`)."""
        self.request_desk.open(namespace)

    def start_monitor(self) -> None:
        self.monitor.start()

    def updating(self):
        """Around a weight update (the engines pause): health checks that overlap it count neither way."""
        return self.monitor.updating()

    def poll(self, version: int) -> list[NodeEvent]:
        """Advance every membership change; returns node events for the driver. Never blocks long:
        each Ray call here is a bounded, quick one."""
        self.version = version
        now = time.monotonic()
        for url, reason in self.monitor.take_dead():
            member = self._serving(url)
            if member is not None:
                self.recovery.lose(member, f"failed its health checks: {reason}")
        self._advance()
        self.recovery.probe_due(now)
        self._synced()
        self.request_desk.take_due(now)
        if self.config.rollout_elastic_resource and now - self._nodes_listed_at >= NODE_POLL_SECONDS:
            self._nodes_listed_at = now
            self._watch_nodes()
        self.request_desk.publish()
        self.recovery.check_progress_possible()
        events, self.events = self.events, []
        return events

    def node_alive(self, node_id: str | None) -> bool:
        """Whether ``node_id`` (None: the driver's choice) is still in the cluster, asked now."""
        if node_id is None:
            return True
        if node_id in self.node_watch.lost:
            return False
        import ray

        try:
            return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
        except Exception:  # noqa: BLE001 - unknown: assume alive, the node watch will tell
            return True

    def stop(self) -> None:
        """Stop the monitor, every engine vime started, and detach from external ones."""
        import ray

        self.monitor.stop()
        live = [m for m in self.members if m.state not in (EngineState.REMOVED, EngineState.LOST)]
        refs = [m.actor.stop.remote() for m in live]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=60)
        for m in self.members:
            try:
                ray.kill(m.actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.members = []

    # ================================================================== membership
    def _actor_class(self):
        import ray

        if self._remote is None:
            self._remote = ray.remote(num_cpus=0, max_restarts=0)(self.actor_class)
        return self._remote

    def _spawn(
        self,
        origin: str,
        *,
        node_id: str | None = None,
        host: str = "127.0.0.1",
        external_url: str | None = None,
        request: str | None = None,
        startup_timeout: float | None = None,
        variant: EngineVariant | None = None,
    ) -> Member:
        index, self._next_index = self._next_index, self._next_index + 1
        spec = self.template.spec(
            index, host=host, external_url=external_url, startup_timeout=startup_timeout, variant=variant
        )
        member = Member(
            index=index,
            origin=origin,
            actor=None,
            spec=spec,
            node_id=node_id,
            url=external_url,
            request=request,
            gpus=spec.tensor_parallel_size,
            prefix=self.template.name_prefix,
        )
        self._create_actor(member)
        self.members.append(member)
        return member

    def _create_actor(self, member: Member) -> None:
        options: dict[str, Any] = {}
        if member.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(member.node_id, soft=False)
        member.actor = self._actor_class().options(**options).remote(member.spec)
        self._pend(
            member,
            member.actor.join.remote(self.template.weight_dir, self._join_version),
            "join",
            member.spec.startup_timeout + JOIN_SLACK_SECONDS,
        )

    @property
    def _join_version(self) -> int:
        """The version a joining engine loads by itself: the current one from disk; with the nccl
        transport nothing is on disk, so it starts from --hf-checkpoint and receives the current
        weights with the next broadcast (the group is re-formed for it: WeightSync)."""
        return self.version if self.template.weight_transport == "disk" else 0

    def _pend(self, member: Member, ref, what: str, timeout: float) -> None:
        member.pending, member.pending_what = ref, what
        member.pending_since = time.monotonic()
        member.deadline = member.pending_since + timeout

    def _advance(self) -> None:
        """Collect every finished join / restart / catch-up / drain (non-blocking)."""
        import ray

        waiting = [m for m in self.members if m.pending is not None]
        if not waiting:
            return
        done, _ = ray.wait([m.pending for m in waiting], num_returns=len(waiting), timeout=0)
        done = set(done)
        now = time.monotonic()
        for m in waiting:
            if m.pending in done:
                ref, what = m.pending, m.pending_what
                m.pending = None
                try:
                    result = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - the engine's failure, handled per member
                    self._call_failed(m, what, error_reason(error))
                    continue
                if what == "drain":
                    self._removed(m, result)
                elif what == "probe":  # a quarantined engine generates again: load the current version
                    self._pend(
                        m,
                        m.actor.rejoin.remote(self.template.weight_dir, self._join_version),
                        "rejoin",
                        self.group.call_timeout,
                    )
                else:
                    self._joined(m, result)
            elif now > m.deadline:
                m.pending = None
                self._call_failed(
                    m, m.pending_what, f"{m.pending_what} did not finish within {m.deadline - m.pending_since:.0f}s"
                )

    def _call_failed(self, m: Member, what: str, reason: str) -> None:
        """A call in an engine's actor failed: a drain still ends in its removal; anything else is a fault."""
        if what == "drain":
            self._removed(m, None, reason)
        else:
            self.recovery.failed(m, what, reason)

    def _joined(self, m: Member, info: dict) -> None:
        """A join / restart / catch-up finished: catch up again, or register and serve."""
        m.url, m.version = info["url"], info["version"]
        m.node_id = info.get("node_id") or m.node_id
        if info.get("found_paused"):
            self.say(
                f"{m.name} ({m.origin}) at {m.url} was paused, as a run stopped during a weight update leaves "
                "an engine; resumed, and its weights reloaded"
            )
        m.gpus, m.worker_type = info.get("gpus") or m.gpus, info.get("worker_type") or "regular"
        if m.version != self.version and self.template.weight_transport != "disk":
            self._await_broadcast(m)
            return
        if m.version != self.version:
            # Versions were published while it joined: load the current one now, synchronously
            # like a weight synchronisation (seconds at most), so that no newer version can be
            # published before it is registered (polls come once per training step).
            import ray

            try:
                info = ray.get(
                    m.actor.catch_up.remote(self.template.weight_dir, self.version), timeout=self.group.call_timeout
                )
            except Exception as error:  # noqa: BLE001 - the engine's failure, handled per member
                self.recovery.failed(m, "catch-up", error_reason(error))
                return
            m.version = info["version"]
            if m.version != self.version:
                self.recovery.failed(m, "catch-up", f"it serves version {m.version}, not the current {self.version}")
                return
        problem = role_refusal(
            m, static_roles=self.static_roles, external_router=self.external_router, router=self.router
        )
        if problem:
            self.recovery.give_up(m, problem)
            return
        self._serve(m, info)

    def _await_broadcast(self, m: Member) -> None:
        """nccl transport: the engine joins the weight group at the next synchronisation (which
        re-forms the group) and is registered with the router once it serves the current version."""
        m.state, m.since, m.last_error = EngineState.SYNCING, time.monotonic(), ""
        self.group.add(m.actor, m.url, workers=m.gpus, version=m.version)
        self.monitor.watch(m.url, self.config.rollout_health_check_first_wait)
        self.say(
            f"{m.name} ({m.origin}) started at {m.url}; it receives weight version {self.version + 1} "
            "with the next broadcast, then serves"
        )

    def _synced(self) -> None:
        """Register the engines that now serve the current version after waiting for a broadcast."""
        for m in self.members:
            if m.state != EngineState.SYNCING or m.url not in self.group.urls:
                continue
            version = self.group.versions[self.group.urls.index(m.url)]
            if version == self.version:
                m.version = version
                self._serve(m, {})

    def _serve(self, m: Member, info: dict) -> None:
        """Register ``m`` with the router and count it as serving."""
        if self.register_with_router and m.worker_type == "regular":
            try:
                self.router.add_worker(m.url)
            except EngineError as error:
                self.recovery.failed(m, "registration", str(error))
                return
        restarted = m.state == EngineState.RESTARTING or m.restarts > 0 and m.state == EngineState.SYNCING
        rejoined = m.state == EngineState.QUARANTINED
        m.state, m.since, m.last_error = EngineState.SERVING, time.monotonic(), ""
        if m.url not in self.group.urls:  # an engine that waited for a broadcast is in already
            self.group.add(m.actor, m.url, workers=m.gpus, version=m.version)
            self.monitor.watch(m.url, self.config.rollout_health_check_first_wait, probe=m.worker_type == "regular")
        seconds = None if rejoined else info.get("startup_seconds")
        role = (
            "; registered with the router"
            if m.worker_type == "regular"
            else f" as {'an' if m.worker_type == 'encoder' else 'a'} {m.worker_type} engine"
        )
        how = ", restarted" if restarted else ", passed its probe again" if rejoined else ""
        self.say(
            f"{m.name} ({m.origin}{how}) serves weight version {m.version} at {m.url}"
            + (f" after {seconds:.0f}s" if seconds else "")
            + role
        )
        if rejoined:
            self.note(f"{m.name} back from quarantine")
        event = "restarted" if restarted else "rejoined" if rejoined else "serving"
        self.record(
            {
                "kind": "engine",
                "event": event,
                "engine": m.name,
                "url": m.url,
                "origin": m.origin,
                "node_id": m.node_id,
                "weight_version": m.version,
                "current_version": self.version,
                "join_seconds": seconds,
            }
        )
        if m.request:
            self.request_desk.finish(
                m,
                True,
                f"{m.name} serves weight version {m.version} at {m.url}"
                + (f" (joined in {seconds:.1f}s)" if seconds else ""),
            )
        if m.origin == "node" and m.node_id and m.node_id not in self._nodes_ready:
            self._nodes_ready.add(m.node_id)
            self.events.append(NodeEvent("ready", m.node_id, m.spec.host))

    def note(self, text: str) -> None:
        """Record an engine fault for the progress line (:meth:`take_notes`)."""
        self.notes.append(text)

    def take_notes(self) -> list[str]:
        """Engine faults since the last call, one short line each (for the progress line)."""
        notes, self.notes = self.notes, []
        return notes

    def serving_counts(self) -> tuple[int, int]:
        """(engines serving, engines of the run not removed or lost)."""
        live = [m for m in self.members if m.state not in (EngineState.REMOVED, EngineState.LOST)]
        return sum(m.state == EngineState.SERVING for m in live), len(live)

    def _serving(self, url: str) -> Member | None:
        return next(
            (m for m in self.members if m.url == url and m.state in (EngineState.SERVING, EngineState.SYNCING)), None
        )

    def snapshot(self) -> dict:
        """The weight version and every engine with its health (what `vime engines list` shows)."""
        health = self.monitor.status()
        served = dict(zip(self.group.urls, self.group.versions))
        engines = []
        for m in self.members:
            if m.state == EngineState.SERVING and m.url in served:
                m.version = served[m.url]
            engines.append(m.describe(health.get(m.url or "", {})))
        return {"weight_version": self.version, "engines": engines}

    # ============================================================ acting on one engine (for recovery and requests)
    def withdraw(self, m: Member) -> None:
        """Take ``m`` out of the weight updates, the health checks and the router (quietly: it may be dead)."""
        self.group.remove(m.url)
        self.monitor.unwatch(m.url)
        self._unregister_quietly(m.url)

    def relaunch(self, m: Member) -> None:
        """Start ``m`` again at the current version: its actor restarts the process, or, when the actor
        died (or hangs) with its process, a new actor on the same node starts one."""
        if actor_alive(m.actor):
            self._pend(
                m,
                m.actor.restart.remote(self.template.weight_dir, self._join_version),
                "restart",
                m.spec.startup_timeout + JOIN_SLACK_SECONDS,
            )
        else:
            import ray

            ray.kill(m.actor)
            self._create_actor(m)

    def probe(self, m: Member) -> None:
        """Ask a quarantined engine for a generation; :meth:`_advance` collects the answer."""
        self._pend(m, m.actor.probe.remote(), "probe", self.template.http_timeout + 30)

    def finish_request(self, m: Member, ok: bool, message: str) -> None:
        """Answer the `vime engines` request ``m`` is carrying out (through the registry)."""
        self.request_desk.finish(m, ok, message)

    def dispose(self, m: Member) -> None:
        """Stop vime's own process (detach from an external one), end the actor; never blocks long."""
        import ray

        try:
            ray.wait([m.actor.stop.remote()], timeout=30)  # a dead actor's call fails at once
        finally:
            ray.kill(m.actor)

    def add_external(self, url: str, *, request: str) -> Member:
        """`vime engines add`: an external engine at ``url`` joins at the current weight version; the
        request is answered when it serves or is dropped. ValueError: it cannot join this run."""
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
        member = self._spawn("added", external_url=url, request=request, startup_timeout=self.template.http_timeout)
        self.say(f"vime engines add {url}: {member.name} loads weight version {self.version}")
        return member

    def remove(self, target: str, *, request: str) -> None:
        """`vime engines remove`: unregister the serving or quarantined engine ``target`` (its name or
        address) and drain it; the request is answered once it is removed. ValueError: no such engine,
        or it is the only one serving."""
        url = target if target.startswith("engine-") else engine_url(target)
        removable = (EngineState.SERVING, EngineState.QUARANTINED)
        member = next((m for m in self.members if url in (m.url, m.name) and m.state in removable), None)
        if member is None:
            raise ValueError(f"no serving or quarantined engine {target} in this run (see `vime engines list`)")
        if member.state == EngineState.QUARANTINED:  # out of the router already, nothing in flight
            member.pending, member.request = None, request
            self._removed(member, 0)
            return
        if sum(m.state == EngineState.SERVING for m in self.members) == 1:
            raise ValueError(f"{member.name} is the only serving engine of the run; add another one first")
        self.group.remove(member.url)
        self.monitor.unwatch(member.url)
        if self.register_with_router:  # not quietly: a router that refuses fails the request
            self.router.remove_worker(member.url)
        member.state, member.request = EngineState.DRAINING, request
        self._pend(member, member.actor.drain.remote(), "drain", self.group.call_timeout)
        self.say(f"vime engines remove {target}: {member.name} unregistered, draining its requests")

    def _removed(self, m: Member, aborted: int | None, error: str | None = None) -> None:
        """A removal ended: drained (``aborted`` requests returned to the queue) or the drain failed."""
        m.state = EngineState.REMOVED
        self.dispose(m)
        what = (
            f"{aborted} request(s) in flight returned to the queue as continuations"
            if aborted is not None
            else f"draining failed ({error}); its groups return to the queue when their requests fail"
        )
        message = f"{m.name} ({m.url}) removed; {what}" + ("" if m.owned else "; the external engine keeps running")
        self.say(message)
        self.record({"kind": "engine", "event": "removed", "engine": m.name, "url": m.url, "aborted": aborted})
        if m.request:
            self.request_desk.finish(m, True, message)

    def _on_call_failure(self, url: str, error: BaseException) -> None:
        """A weight update or pause failed on one engine (EngineGroup has taken it out already)."""
        member = self._serving(url)
        if member is not None:
            self.recovery.lose(member, f"a call failed: {error_reason(error)}")

    def _unregister_quietly(self, url: str | None) -> None:
        member = next((m for m in self.members if m.url == url), None)
        if member is not None and member.worker_type != "regular":
            return  # never registered (an encoder), or listed on the PD router's command line for good
        if url and self.register_with_router:
            try:
                self.router.remove_worker(url)
            except EngineError:
                pass  # the router checks health too: a dead engine leaves its rotation anyway

    # ================================================================== nodes
    def _watch_nodes(self) -> None:
        import ray

        try:
            nodes = ray.nodes()
        except Exception as error:  # noqa: BLE001 - try again at the next poll
            self.say(f"listing Ray nodes failed: {error_reason(error)}")
            return
        left, joined = self.node_watch.scan(nodes, hosting=(m.node_id for m in self.members))
        for node_id in left:
            self.say(f"node {node_id[:12]} left the Ray cluster")
            self.recovery.node_left(node_id)
            self.events.append(NodeEvent("lost", node_id))
        for node in joined:
            resource = f"{self.node_watch.resource}={node.amount:g}"
            joined_as = f"node {node.node_id[:12]} at {node.host} joined with {resource}"
            if not node.engines:  # --no-rollout-elastic-node-engines: its rollout worker needs no engine to wait for
                self.say(f"{joined_as}: starting a rollout worker there (--no-rollout-elastic-node-engines)")
                self.events.append(NodeEvent("ready", node.node_id, node.host))
                continue
            self.say(f"{joined_as}: starting {node.engines} engine(s) there at weight version {self.version}")
            for _ in range(node.engines):
                self._spawn("node", node_id=node.node_id, host=node.host)
