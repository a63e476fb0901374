"""The models of a ``--vllm-config`` deployment besides the trained one, each behind its own router.

vime trains one model: the deployment's weight-synced model (``update_weights: true``), served
through the run's main router and :class:`~vime.workers.engine_manager.EngineManager`, which the
driver sets up itself. Every other model (a frozen reference, a reward model, a distillation
teacher) is a :class:`FrozenModel` here: a vllm-router of its own and an engine manager that keeps
its engines serving the model's own checkpoint. Health checks and restarts work as for the trained
model's engines; weight updates never reach them (their version 0 is the model's checkpoint), and
elastic nodes only receive engines of the trained model. Custom code reaches a model through
``get_model_url(args, name)`` (``args.vllm_model_routers``, filled by the driver).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from vime.config.framework import ElasticConfig
from vime.config.vllm_config import EngineLaunch, ModelLaunch
from vime.engines.router import RouterClient, RouterProcess, start_router
from vime.workers.engine_manager import EngineManager, EngineTemplate, EngineVariant, EnginesLost


def engine_variants(engines: tuple[EngineLaunch, ...], extra_args: Callable[[dict], dict]) -> list[EngineVariant]:
    """Each planned engine's vLLM flags (``extra_args`` adds what the weight transport needs) and size."""
    return [EngineVariant(vllm_args=extra_args(engine.vllm_args), tensor_parallel_size=engine.tensor_parallel_size)
            for engine in engines]


@dataclasses.dataclass
class FrozenModel:
    name: str
    router: RouterProcess
    manager: EngineManager

    @property
    def address(self) -> tuple[str, int]:
        """(ip, port) of its router: the value of ``args.vllm_model_routers[name]``."""
        return self.router.host, self.router.port

    def wait_serving(self) -> None:
        """Block until every engine of the model serves (an error names the engine and its log,
        ``<model>-engine-<i>.log``), then watch their health."""
        self.manager.wait_started()
        self.manager.start_monitor()

    def poll(self) -> None:
        """Health and restarts (never blocks long); raises EnginesLost naming the model."""
        try:
            self.manager.poll(0)
        except EnginesLost as error:
            raise EnginesLost(f"model {self.name!r} of --vllm-config: {error}") from None

    def stop(self) -> None:
        try:
            self.manager.stop()
        finally:
            self.router.stop()


def start_frozen_model(launch: ModelLaunch, *, template: EngineTemplate, elastic: ElasticConfig, log_dir: str,
                       run_token: str, http_timeout: float, say: Callable[[str], None],
                       record: Callable[[dict], None]) -> FrozenModel:
    """Start ``launch``'s router, then its engines, without waiting for them (the driver calls
    :meth:`FrozenModel.wait_serving`, so that every model's engines start at the same time); on a
    failure here, what was started is stopped."""
    unsupported = sorted({e.worker_type for e in launch.engines if e.worker_type != "regular"})
    if unsupported:
        raise NotImplementedError(f"model {launch.name!r}: vime starts regular engines only; "
                                  f"{', '.join(unsupported)} groups are not started yet (docs/vllm-config.md)")
    router = start_router(log_path=os.path.join(log_dir, f"router-{launch.name}.log"), run_token=run_token,
                          router_args=launch.router.router_args, say=say)
    manager = None
    try:
        template = dataclasses.replace(template, model=launch.model_path, name_prefix=f"{launch.name}-")
        # Engines on nodes that join the cluster are the trained model's business only.
        frozen_elastic = dataclasses.replace(elastic, rollout_elastic_resource=None)
        manager = EngineManager(template=template, config=frozen_elastic,
                                router=RouterClient(router.url, timeout=http_timeout), say=say, record=record)
        engines = launch.language_engines
        if engines:
            say(f"model {launch.name!r} ({launch.model_path}, frozen): starting {len(engines)} engine(s) behind "
                f"its router {router.url}")
            manager.spawn_owned(len(engines), variants=engine_variants(engines, dict))
    except BaseException:
        if manager is not None:
            manager.stop()
        router.stop()
        raise
    return FrozenModel(name=launch.name, router=router, manager=manager)
