"""Every model a run serves: the trained model's router and engines, and the frozen models of --vllm-config.

:class:`ModelServing` owns what answers generate requests, and what happens when part of it dies:

- the trained model's **router** (vime's own, restarted at its address when it dies:
  workers/router_supervisor.py; or the user's, ``--vllm-router-ip``);
- its **engines**, through the :class:`~vime.workers.engine_manager.EngineManager` (health checks,
  restarts, quarantine, `vime engines`, nodes that join or leave: docs/elastic.md), which also applies
  the weight updates (``engines``);
- every other model of ``--vllm-config`` (:class:`~vime.workers.model_servers.FrozenModel`: its own
  router and engines, never a weight update).

The driver starts it once (:meth:`ModelServing.start`), polls it between steps and while it waits for
groups (:meth:`ModelServing.poll`), and stops it in its teardown (:meth:`ModelServing.stop_steps`). The
order the models' roles need is in workers/model_servers.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from vime.config import TrainSettings
from vime.workers.engine_manager import EngineManager
from vime.workers.engine_members import EngineTemplate, NodeEvent
from vime.workers.model_servers import (
    FrozenModel,
    engine_variants,
    has_static_roles,
    pd_router_args,
    start_encoders,
    start_frozen_model,
    supervise_router,
)
from vime.workers.router_supervisor import RouterSupervisor


class ModelServing:
    """The models a run serves. ``plan`` is the launch plan of ``--vllm-config`` (None without one) and
    ``trained_model`` its weight-synced model's name; ``say`` and ``record`` are the run's progress output
    and ``metrics.jsonl``."""

    def __init__(
        self,
        settings: TrainSettings,
        *,
        plan,
        trained_model: str | None,
        run_dir: str,
        run_token: str,
        say: Callable[[str], None],
        record: Callable[[dict], None],
    ):
        self.s = settings
        self.plan = plan
        self.trained_model = trained_model
        self.log_dir = os.path.join(run_dir, "logs")
        self.run_token = run_token
        self.say = say
        self.record = record
        self.router = None  # vime.engines.router.RouterProcess: vime's own router, if any
        self.router_client = None
        self.router_url: str | None = None
        self.router_supervisor: RouterSupervisor | None = None
        self.engine_manager: EngineManager | None = None
        self.engines = None  # vime.workers.engines.EngineGroup: the trained model's serving engines
        self.frozen_models: list[FrozenModel] = []

    # ------------------------------------------------------------------ start
    def start(self, registry_namespace: str, on_router: Callable[[], None] | None = None) -> None:
        """Every model's router and engines in the order their roles need (workers/model_servers.py): the
        trained model's (vime's own, or --rollout-external-engine-addrs) with the engine registry `vime
        engines` talks to (in ``registry_namespace``) and the health monitor, and the other models of
        --vllm-config, whose engines start at the same time. Then the models' endpoints are published to
        ``args`` for user code (get_model_url, prime_encoder). ``on_router`` is called once ``args`` holds every
        endpoint: for a run of one model, as soon as its router is up, before its engines serve; with
        --vllm-config, at the end."""
        s = self.s
        launch = self.plan.model(self.trained_model) if self.plan else None
        pd = launch is not None and launch.router.pd_disaggregation
        if not pd:  # regular engines register with their router once they serve: it starts first
            self._start_router(launch.router.router_args if launch else s.router_args)
        early = self.plan is None  # one model: its router is the only endpoint, and it is known now
        if early:
            self._publish_model_endpoints({})
            if on_router is not None:
                on_router()
        template = self._engine_template()
        self._make_engine_manager(template, launch, pd=pd)
        started = time.monotonic()
        encoders = (
            {launch.name: start_encoders(self.engine_manager, launch, s.weights.engine_vllm_args)} if launch else {}
        )
        self._start_frozen_models(template)  # their language engines start while the trained model's do
        self._start_trained_engines(launch)
        if pd:  # a PD router learns its engines from its command line: they serve by now
            self._start_router(pd_router_args(launch, self.engine_manager))
            self.engine_manager.router = self.router_client
        if self.router is not None:
            self.router_supervisor = supervise_router(
                self.router,
                self.router_client,
                self.engine_manager,
                model=self.trained_model or "default",
                budget=s.elastic.rollout_router_restart_budget,
                say=self.say,
                record=self.record,
            )
        if len(self.engines):
            self.say(
                f"{len(self.engines)} engine(s) serving after {time.monotonic() - started:.0f}s behind the "
                f"router {self.router_url}: {', '.join(self.engines.urls)}"
            )
        self.engine_manager.open_registry(registry_namespace)
        self.engine_manager.start_monitor()
        for model in self.frozen_models:
            model.wait_serving()
            encoders[model.name] = model.encoder_urls
            self.say(
                f"model {model.name!r}: {len(model.manager.group)} engine(s) serving behind its router "
                f"{model.router.url}"
            )
        self._publish_model_endpoints(encoders)
        if not early and on_router is not None:
            on_router()

    def _start_router(self, router_args: dict) -> None:
        """The trained model's router (vime's own, or --vllm-router-ip); every other model of
        --vllm-config gets its own (workers/model_servers.py)."""
        from vime.engines.router import RouterClient, start_router

        s = self.s
        if s.vllm.vllm_router_ip:
            port = s.vllm.vllm_router_port or 30000
            self.router_url = f"http://{s.vllm.vllm_router_ip}:{port}"
            self.say(f"using the external router at {self.router_url}")
        else:
            self.router = start_router(
                log_path=os.path.join(self.log_dir, "router.log"),
                run_token=self.run_token,
                router_args=router_args,
                port=s.vllm.vllm_router_port,
                say=self.say,
            )
            self.router_url = self.router.url
        self.router_client = RouterClient(self.router_url, timeout=s.run.http_timeout)
        s.args.vllm_router_ip, s.args.vllm_router_port = self.router_url.split("//")[1].rsplit(":", 1)

    def _engine_template(self) -> EngineTemplate:
        """What every engine of the trained model starts from (frozen models take it with their own path)."""
        s = self.s
        return EngineTemplate(
            model=s.train.hf_checkpoint,
            vllm_args=s.weights.engine_vllm_args(s.vllm.vllm_args),
            tensor_parallel_size=s.cluster.rollout_num_gpus_per_engine,
            run_token=self.run_token,
            log_dir=self.log_dir,
            startup_timeout=s.run.engine_startup_timeout,
            http_timeout=s.run.http_timeout,
            weight_dir=s.weight_dir,
            weight_transport=s.weights.update_weight_transport,
            weights_local_dir=s.weights.update_weight_local_checkpoint_dir,
            weight_buffer_bytes=s.weights.update_weight_buffer_size,
            sleep_mode=bool(s.rollout_sleep_level),
        )

    def _make_engine_manager(self, template: EngineTemplate, launch, *, pd: bool) -> None:
        s = self.s
        static = launch is not None and has_static_roles(launch)
        # A PD router lists its engines from its command line: nodes that join get no engines then.
        elastic = dataclasses.replace(s.elastic, rollout_elastic_resource=None) if static else s.elastic
        self.engine_manager = EngineManager(
            template=template,
            config=elastic,
            router=self.router_client,
            say=self.say,
            record=self.record,
            external_router=self.router is None and not pd,
            static_roles=static,
        )
        self.engines = self.engine_manager.group

    def _start_trained_engines(self, launch) -> None:
        """The trained model's language engines: --rollout-external-engine-addrs, or the planned ones."""
        s = self.s
        external = getattr(s.args, "rollout_external_engine_addrs", None) or []
        planned = launch.language_engines if launch else ()
        if external:
            self.say(f"attaching {len(external)} external engine(s): {' '.join(external)}")
            self.engine_manager.attach_external(external)
        elif planned:
            self.say(
                f"starting {len(planned)} vLLM engine(s); waiting up to {s.run.engine_startup_timeout:.0f}s "
                f"for each (logs in {self.log_dir})"
            )
            self.engine_manager.start_owned(len(planned), variants=engine_variants(planned, s.weights.engine_vllm_args))
        else:
            self.say("--rollout-num-gpus 0: no local engines")

    def _start_frozen_models(self, template: EngineTemplate) -> None:
        """Start (waiting only for encoders) every model of --vllm-config besides the trained one."""
        s = self.s
        for launch in self.plan.models if self.plan else ():
            if launch.name != self.trained_model:
                self.frozen_models.append(
                    start_frozen_model(
                        launch,
                        template=template,
                        elastic=s.elastic,
                        log_dir=self.log_dir,
                        run_token=self.run_token,
                        http_timeout=s.run.http_timeout,
                        say=self.say,
                        record=self.record,
                    )
                )

    def _publish_model_endpoints(self, encoders: dict[str, list[str]]) -> None:
        """get_model_url(args, name) and prime_encoder in rewards, rollout functions and hooks
        (docs/vllm-config.md)."""
        routers = {self.trained_model or "default": self.router_url}
        routers.update({model.name: model.address for model in self.frozen_models})
        self.s.args.vllm_model_routers = routers
        if self.plan is not None:
            self.s.args.vllm_model_encoder_endpoints = self.plan.encoder_endpoints(encoders)

    # ------------------------------------------------------------------ poll
    def poll(self, version: int) -> list[NodeEvent]:
        """Routers, engines and frozen models: restarts, health, membership (never blocks long, but for a
        router's restart: seconds). Returns the node events of the trained model's engines; raises
        EnginesLost (RouterLost included) when a model can no longer serve."""
        if self.engine_manager is None:
            return []
        if self.router_supervisor is not None:  # a dead router stops all generation: first
            self.router_supervisor.poll()
        events = self.engine_manager.poll(version)
        for model in self.frozen_models:
            model.poll()
        return events

    def health(self) -> dict[str, Any]:
        """For the step's record and progress line: engines serving, and the engine faults since the last
        step (quarantines, restarts, drops)."""
        if self.engine_manager is None:
            return {}
        serving, total = self.engine_manager.serving_counts()
        return {"engines_serving": serving, "engines_total": total, "engine_faults": self.engine_manager.take_notes()}

    def describe_engines(self) -> str:
        """One line naming every engine of the trained model with its state and URL (for errors)."""
        if self.engine_manager is None:
            return ""
        return ", ".join(f"{e['name']} {e['state']} at {e['url']}" for e in self.engine_manager.snapshot()["engines"])

    # ------------------------------------------------------------------ stop
    def end(self) -> None:
        """The run is ending: an engine lost from now on is not restarted."""
        if self.engine_manager is not None:
            self.engine_manager.ending = True
        for model in self.frozen_models:
            model.manager.ending = True

    def abort_requests(self) -> None:
        """Requests in flight end now (finish_reason "abort"): their groups go back to the queue as
        continuations carrying what was generated, instead of being waited for. The engines resume at
        once: a request that reaches them later simply completes."""
        if self.engines is not None:
            self.engines.pause("abort")
            self.engines.resume()

    def stop_steps(self) -> list[tuple[str, Callable[[], Any]]]:
        """The teardown's steps for what this serves, in reverse start order, each named for the progress
        output: the trained model's engines, every frozen model, the router, the encoder cache."""
        return [
            ("the engines", lambda: self.engine_manager and self.engine_manager.stop()),
            *((f"model {model.name!r}", model.stop) for model in self.frozen_models),
            ("the router", lambda: self.router and self.router.stop()),
            ("the encoder cache", self._remove_encoder_cache),
        ]

    def _remove_encoder_cache(self) -> None:
        """EPD: the embeddings vime's default encoder cache kept in shared memory (docs/vllm-config.md)."""
        if self.plan is not None and self.plan.owned_ec_cache:
            shutil.rmtree(self.plan.owned_ec_cache, ignore_errors=True)
