"""Starting a model of the engine topology (``--vllm-config``): its engines in order, and its router.

Every model gets its own vllm-router. The order follows the roles of its engines (the launch plan of
vime/config/vllm_launch.py):

- **encoders** (EPD) start first and are waited for: the language engines read the embeddings they
  produce. They are never registered with a router; their URLs become
  ``args.vllm_model_encoder_endpoints`` (for ``prime_encoder``).
- **regular** engines: the router starts first and each engine registers with it once it serves.
- **prefill/decode** (PD): vllm-router learns them from its command line (``--prefill URL``,
  ``--decode URL``), so the engines start first and the router after them. They keep their port when
  restarted, so that the router's list stays right.

vime trains one model, the deployment's weight-synced one; the driver sets up its engine manager
(with weight updates, `vime engines`, elastic nodes) through the same helpers. Every other model (a
frozen reference, a reward model, a distillation teacher) is a :class:`FrozenModel`: health checks
and restarts as for the trained model's engines, never a weight update (its version 0 is its own
checkpoint). Custom code reaches a model through ``get_model_url(args, name)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from vime.config.elastic import ElasticConfig
from vime.config.vllm_launch import EngineLaunch, ModelLaunch
from vime.engines.router import RouterClient, RouterProcess, start_router
from vime.workers.engine_manager import EngineManager
from vime.workers.engine_members import EnginesLost, EngineTemplate, EngineVariant
from vime.workers.router_supervisor import RouterSupervisor


def engine_variants(engines: tuple[EngineLaunch, ...], extra_args: Callable[[dict], dict]) -> list[EngineVariant]:
    """Each planned engine's vLLM flags (``extra_args`` adds what the weight transport needs), size and role."""
    return [
        EngineVariant(
            vllm_args=extra_args(engine.vllm_args),
            tensor_parallel_size=engine.tensor_parallel_size,
            worker_type=engine.worker_type,
        )
        for engine in engines
    ]


def has_static_roles(launch: ModelLaunch) -> bool:
    """Whether the model runs engines the router does not register at run time (PD, encoders)."""
    return any(engine.worker_type != "regular" for engine in launch.engines)


def serving_urls(manager: EngineManager, worker_type: str) -> list[str]:
    return [m.url for m in manager.members if m.worker_type == worker_type and m.state == "serving"]


def supervise_router(
    router: RouterProcess,
    client: RouterClient,
    manager: EngineManager,
    *,
    model: str,
    budget: int,
    say: Callable[[str], None],
    record: Callable[[dict], None],
) -> RouterSupervisor:
    """A supervisor that restarts ``router`` when it dies and registers the model's serving regular
    engines with it again (a PD router's command line lists its prefill/decode engines already)."""
    return RouterSupervisor(
        router,
        client,
        model=model,
        budget=budget,
        engine_urls=lambda: serving_urls(manager, "regular"),
        say=say,
        record=record,
    )


def pd_router_args(launch: ModelLaunch, manager: EngineManager) -> dict:
    """The PD router's flags: the plan's (``vllm-pd-disaggregation``, the KV connector), then every
    prefill and decode engine of the model, which serve by now."""
    return {
        **launch.router.router_args,
        "prefill": serving_urls(manager, "prefill"),
        "decode": serving_urls(manager, "decode"),
    }


def start_encoders(manager: EngineManager, launch: ModelLaunch, extra_args: Callable[[dict], dict]) -> list[str]:
    """EPD: start the model's encoders and wait until they serve; returns their URLs."""
    if not launch.encoders:
        return []
    manager.start_owned(len(launch.encoders), variants=engine_variants(launch.encoders, extra_args))
    return serving_urls(manager, "encoder")


@dataclasses.dataclass
class FrozenModel:
    name: str
    launch: ModelLaunch
    manager: EngineManager
    log_dir: str
    run_token: str
    http_timeout: float
    say: Callable[[str], None]
    record: Callable[[dict], None]
    router_restart_budget: int
    router: RouterProcess | None = None  # started after the engines for a PD model
    router_supervisor: RouterSupervisor | None = None
    encoder_urls: list[str] = dataclasses.field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        """(ip, port) of its router: the value of ``args.vllm_model_routers[name]``."""
        return self.router.host, self.router.port

    def start_router(self, router_args: dict) -> None:
        self.router = start_router(
            log_path=os.path.join(self.log_dir, f"router-{self.name}.log"),
            run_token=self.run_token,
            router_args=router_args,
            say=self.say,
        )
        self.manager.router = RouterClient(self.router.url, timeout=self.http_timeout)
        self.router_supervisor = supervise_router(
            self.router,
            self.manager.router,
            self.manager,
            model=self.name,
            budget=self.router_restart_budget,
            say=self.say,
            record=self.record,
        )

    def wait_serving(self) -> None:
        """Block until every engine of the model serves (an error names the engine and its log,
        ``<model>-engine-<i>.log``); then a PD model's router; then watch their health."""
        self.manager.wait_started()
        if self.router is None:
            self.start_router(pd_router_args(self.launch, self.manager))
        self.manager.start_monitor()

    def poll(self) -> None:
        """Health and restarts (never blocks long); raises EnginesLost naming the model."""
        try:
            if self.router_supervisor is not None:
                self.router_supervisor.poll()
            self.manager.poll(0)
        except EnginesLost as error:
            raise EnginesLost(f"model {self.name!r} of --vllm-config: {error}") from None

    def stop(self) -> None:
        try:
            self.manager.stop()
        finally:
            if self.router is not None:
                self.router.stop()


def start_frozen_model(
    launch: ModelLaunch,
    *,
    template: EngineTemplate,
    elastic: ElasticConfig,
    log_dir: str,
    run_token: str,
    http_timeout: float,
    say: Callable[[str], None],
    record: Callable[[dict], None],
) -> FrozenModel:
    """Start ``launch``'s router (unless PD: it follows the engines) and its engines, waiting only for
    encoders; the driver calls :meth:`FrozenModel.wait_serving`, so that every model's language
    engines start at the same time. On a failure here, what was started is stopped."""
    template = dataclasses.replace(template, model=launch.model_path, name_prefix=f"{launch.name}-")
    # Engines on nodes that join the cluster are the trained model's business only.
    frozen_elastic = dataclasses.replace(elastic, rollout_elastic_resource=None)
    manager = EngineManager(
        template=template,
        config=frozen_elastic,
        router=None,
        say=say,
        record=record,
        static_roles=has_static_roles(launch),
    )
    model = FrozenModel(
        name=launch.name,
        launch=launch,
        manager=manager,
        log_dir=log_dir,
        run_token=run_token,
        http_timeout=http_timeout,
        say=say,
        record=record,
        router_restart_budget=elastic.rollout_router_restart_budget,
    )
    try:
        if not launch.router.pd_disaggregation:
            model.start_router(launch.router.router_args)
        model.encoder_urls = start_encoders(manager, launch, dict)
        engines = launch.language_engines
        if engines:
            say(f"model {launch.name!r} ({launch.model_path}, frozen): starting {len(engines)} engine(s)")
            manager.spawn_owned(len(engines), variants=engine_variants(engines, dict))
    except BaseException:
        model.stop()
        raise
    return model
