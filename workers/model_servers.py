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

Every served model is a :class:`ModelServer` (its router, supervised, and its engines, health-checked
and restarted). vime trains one of them, the deployment's weight-synced model (workers/serving.py adds
what only it has: weight updates, `vime engines`, elastic nodes, the user's own router or engines).
Every other model (a frozen reference, a reward model, a distillation teacher) is started by
:func:`start_frozen_model` and never receives a weight update (its version 0 is its own checkpoint).
Custom code reaches a model through ``get_model_url(args, name)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from vime.config.elastic import ElasticConfig
from vime.config.vllm_launch import EngineLaunch, ModelLaunch
from vime.engines.router import RouterClient, RouterProcess, start_router
from vime.workers.engine_manager import EngineManager
from vime.workers.engine_members import EnginesLost, EngineState, EngineTemplate, EngineVariant, NodeEvent
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
    return [m.url for m in manager.members if m.worker_type == worker_type and m.state == EngineState.SERVING]


def pd_router_args(launch: ModelLaunch, manager: EngineManager) -> dict:
    """The PD router's flags: the plan's (``vllm-pd-disaggregation``, the KV connector), then every
    prefill and decode engine of the model, which serve by now."""
    return {
        **launch.router.router_args,
        "prefill": serving_urls(manager, "prefill"),
        "decode": serving_urls(manager, "decode"),
    }


class ModelServer:
    """One served model, trained or frozen: its engines (an :class:`EngineManager`: health checks,
    restarts, quarantine) and its router, which vime starts and supervises (restarted at its address
    when it dies: workers/router_supervisor.py) unless it is the user's (``--vllm-router-ip``).

    ``name`` keys ``args.vllm_model_routers``; ``frozen`` models never receive a weight update (their
    version 0 is their own checkpoint) and name themselves in their errors. The trained model's server
    is the one whose engines the run's weight synchronisation updates (:attr:`engines`)."""

    def __init__(
        self,
        name: str,
        manager: EngineManager,
        *,
        launch: ModelLaunch | None,
        frozen: bool,
        log_dir: str,
        run_token: str,
        http_timeout: float,
        router_restart_budget: int,
        say: Callable[[str], None],
        record: Callable[[dict], None],
    ):
        self.name = name
        self.manager = manager
        self.launch = launch  # None: a run of one model, without --vllm-config
        self.frozen = frozen
        self.log_dir = log_dir
        self.run_token = run_token
        self.http_timeout = http_timeout
        self.router_restart_budget = router_restart_budget
        self.say, self.record = say, record
        self.router: RouterProcess | None = None  # vime's own router; None for the user's, or before it starts
        self.router_url: str | None = None
        self.router_supervisor: RouterSupervisor | None = None
        self.encoder_urls: list[str] = []

    @property
    def engines(self):
        """The :class:`~vime.workers.engines.EngineGroup` of the engines that serve (what a weight update reaches)."""
        return self.manager.group

    @property
    def pd(self) -> bool:
        """Prefill/decode engines: the router learns them from its command line, so it starts after them."""
        return self.launch is not None and self.launch.router.pd_disaggregation

    @property
    def address(self) -> tuple[str, int]:
        """(ip, port) of its router: the value of ``args.vllm_model_routers[name]``."""
        host, port = self.router_url.split("//", 1)[1].rsplit(":", 1)
        return host.strip("[]"), int(port)  # an IPv6 host without its URL brackets (get_model_url adds them)

    # ------------------------------------------------------------------ start
    def start_router(self, router_args: dict, *, port: int | None = None) -> None:
        """Start the model's own vllm-router (``port`` None: a free one) and supervise it."""
        log_name = "router.log" if not self.frozen else f"router-{self.name}.log"
        self.router = start_router(
            log_path=os.path.join(self.log_dir, log_name),
            run_token=self.run_token,
            router_args=router_args,
            port=port,
            say=self.say,
        )
        self._use_router(self.router.url)
        self.router_supervisor = RouterSupervisor(
            self.router,
            self.manager.router,
            model=self.name,
            budget=self.router_restart_budget,
            # A PD router's command line lists its prefill/decode engines: a restart with it is enough.
            engine_urls=lambda: serving_urls(self.manager, "regular"),
            say=self.say,
            record=self.record,
        )

    def use_external_router(self, url: str) -> None:
        """The user's router (``--vllm-router-ip``): its owner runs it, so it is not supervised."""
        self.say(f"using the external router at {url}")
        self._use_router(url)

    def _use_router(self, url: str) -> None:
        self.router_url = url
        self.manager.router = RouterClient(url, timeout=self.http_timeout)

    def start_encoders(self, extra_args: Callable[[dict], dict]) -> None:
        """EPD: start the model's encoders and wait until they serve (the language engines read them)."""
        if self.launch is not None and self.launch.encoders:
            self.manager.start_owned(
                len(self.launch.encoders), variants=engine_variants(self.launch.encoders, extra_args)
            )
            self.encoder_urls = serving_urls(self.manager, "encoder")

    def wait_serving(self) -> None:
        """Block until every engine serves (an error names the engine and its log); then a PD model's
        router, which lists them; then watch their health."""
        self.manager.wait_started()
        if self.pd:
            self.start_router(pd_router_args(self.launch, self.manager))
        self.manager.start_monitor()

    # ------------------------------------------------------------------ while the run runs
    def poll(self, version: int) -> list[NodeEvent]:
        """The router first (a dead one stops all generation; its restart blocks for seconds), then the
        engines' health, restarts and membership at ``version``. Returns the engines' node events; raises
        EnginesLost (RouterLost included) when the model can no longer serve, naming a frozen model."""
        try:
            if self.router_supervisor is not None:
                self.router_supervisor.poll()
            return self.manager.poll(version)
        except EnginesLost as error:
            if not self.frozen:
                raise
            raise EnginesLost(f"model {self.name!r} of --vllm-config: {error}") from None

    def end(self) -> None:
        """The run is ending: an engine lost from now on is not restarted."""
        self.manager.ending = True

    # ------------------------------------------------------------------ stop
    def stop_engines(self) -> None:
        self.manager.stop()

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()

    def stop(self) -> None:
        try:
            self.stop_engines()
        finally:
            self.stop_router()


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
) -> ModelServer:
    """Start ``launch``'s router (unless PD: it follows the engines) and its engines, waiting only for
    encoders; the driver calls :meth:`ModelServer.wait_serving`, so that every model's language
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
    model = ModelServer(
        launch.name,
        manager,
        launch=launch,
        frozen=True,
        log_dir=log_dir,
        run_token=run_token,
        http_timeout=http_timeout,
        router_restart_budget=elastic.rollout_router_restart_budget,
        say=say,
        record=record,
    )
    try:
        if not model.pd:
            model.start_router(launch.router.router_args)
        model.start_encoders(dict)
        engines = launch.language_engines
        if engines:
            say(f"model {launch.name!r} ({launch.model_path}, frozen): starting {len(engines)} engine(s)")
            manager.spawn_owned(len(engines), variants=engine_variants(engines, dict))
    except BaseException:
        model.stop()
        raise
    return model
