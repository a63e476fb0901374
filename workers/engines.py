"""Engine actors and the group that fans out calls to them.

One ``EngineActor`` per vLLM engine runs on the node that hosts the engine and owns its process.
Weight updates, pauses and version changes are sent to every engine directly (the router would
forward such calls to one worker only); generation goes through the router.

On crash of an engine actor its vLLM process dies with it (PDEATHSIG + the run token sweep).
"""

from __future__ import annotations

import dataclasses
import time

from vime.engines.vllm_server import EngineClient, VllmServer, update_engine_weights


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


class EngineActor:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.server: VllmServer | None = None
        self.client: EngineClient | None = None
        self.version = 0

    def start(self, version: int = 0) -> str:
        """Start the engine, wait until healthy, label its weights ``version``; returns its URL."""
        started = time.monotonic()
        self.server = VllmServer(self.spec.model, log_path=self.spec.log_path, run_token=self.spec.run_token,
                                 host=self.spec.host, vllm_args=self.spec.vllm_args,
                                 tensor_parallel_size=self.spec.tensor_parallel_size, cpu_cores=self.spec.cpu_cores)
        self.server.start()
        self.server.wait_healthy(timeout=self.spec.startup_timeout)
        self.client = EngineClient(self.server.url, timeout=self.spec.http_timeout)
        self.client.update_weight_version(version)
        self.version = version
        self.startup_seconds = time.monotonic() - started
        return self.server.url

    def info(self) -> dict:
        return {"index": self.spec.index, "url": self.server.url if self.server else None, "version": self.version,
                "healthy": bool(self.client and self.client.health()), "log": self.spec.log_path,
                "startup_seconds": getattr(self, "startup_seconds", None)}

    def update_weights(self, path: str, version: int, flush: bool) -> float:
        started = time.monotonic()
        update_engine_weights(self.client, path, version, flush)
        self.version = version
        return time.monotonic() - started

    def pause(self, mode: str) -> None:
        self.client.pause(mode=mode)

    def resume(self) -> None:
        self.client.resume()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class EngineGroup:
    """Driver-side handle on all engine actors."""

    def __init__(self, actors: list, urls: list[str]):
        self.actors, self.urls = actors, urls
        self.syncs = 0

    @classmethod
    def start(cls, specs: list[EngineSpec], *, version: int = 0) -> "EngineGroup":
        import ray

        remote = ray.remote(num_cpus=0, max_restarts=0)(EngineActor)
        actors = [remote.options(name=None).remote(spec) for spec in specs]
        urls = ray.get([actor.start.remote(version) for actor in actors])
        return cls(actors, urls)

    def update_weights(self, path: str, version: int, *, flush: bool) -> float:
        """Every engine loads ``version``; returns the slowest engine's seconds."""
        import ray

        seconds = ray.get([actor.update_weights.remote(path, version, flush) for actor in self.actors])
        self.syncs += 1
        return max(seconds, default=0.0)

    def pause(self, mode: str) -> None:
        import ray

        ray.get([actor.pause.remote(mode) for actor in self.actors])

    def resume(self) -> None:
        import ray

        ray.get([actor.resume.remote() for actor in self.actors])

    def stop(self) -> None:
        import ray

        try:
            ray.get([actor.stop.remote() for actor in self.actors], timeout=60)
        finally:
            for actor in self.actors:
                ray.kill(actor)
