"""Every model a run serves: the trained model's router and engines, and the frozen models of --vllm-config.

:class:`ModelServing` owns what answers generate requests, and what happens when part of it dies:

- the trained model's **router** (vime's own, restarted at its address when it dies:
  workers/router_supervisor.py; or the user's, ``--vllm-router-ip``);
- its **engines**, through the :class:`~vime.workers.engine_manager.EngineManager` (health checks,
  restarts, quarantine, `vime engines`, nodes that join or leave: docs/elastic.md), which also applies
  the weight updates (``engines``);
- every other model of ``--vllm-config`` (frozen: its own router and engines, never a weight update).

Each model, trained or frozen, is a :class:`~vime.workers.model_servers.ModelServer`; what is the trained
model's alone (weight updates, the engine registry of `vime engines`, elastic nodes, the user's router or
engines) is set up here.

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
    ModelServer,
    engine_variants,
    has_static_roles,
    pd_router_args,
    start_frozen_model,
)


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
        self.trained: ModelServer | None = None
        self.frozen_models: list[ModelServer] = []

    # what the driver reads of the trained model
    @property
    def router_url(self) -> str | None:
        return self.trained.router_url if self.trained else None

    @property
    def engine_manager(self) -> EngineManager | None:
        return self.trained.manager if self.trained else None

    @property
    def engines(self):
        """The trained model's serving engines (an EngineGroup): what weight synchronisation updates."""
        return self.trained.engines if self.trained else None

    def _models(self) -> list[ModelServer]:
        return ([self.trained] if self.trained is not None else []) + self.frozen_models

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
        template = self._engine_template()
        trained = self.trained = self._trained_server(template, launch)
        if not trained.pd:  # regular engines register with their router once they serve: it starts first
            self._start_trained_router(launch.router.router_args if launch else s.router_args)
        early = self.plan is None  # one model: its router is the only endpoint, and it is known now
        if early:
            self._publish_model_endpoints()
            if on_router is not None:
                on_router()
        started = time.monotonic()
        trained.start_encoders(s.weights.engine_vllm_args)
        self._start_frozen_models(template)  # their language engines start while the trained model's do
        self._start_trained_engines(launch)
        if trained.pd:  # a PD router learns its engines from its command line: they serve by now
            self._start_trained_router(pd_router_args(launch, trained.manager))
        engines = trained.engines
        if len(engines):
            self.say(
                f"{len(engines)} engine(s) serving after {time.monotonic() - started:.0f}s behind the "
                f"router {trained.router_url}: {', '.join(engines.urls)}"
            )
        trained.manager.open_registry(registry_namespace)
        trained.manager.start_monitor()
        for model in self.frozen_models:
            model.wait_serving()
            self.say(
                f"model {model.name!r}: {len(model.engines)} engine(s) serving behind its router {model.router_url}"
            )
        self._publish_model_endpoints()
        if not early and on_router is not None:
            on_router()

    def _trained_server(self, template: EngineTemplate, launch) -> ModelServer:
        s = self.s
        static = launch is not None and has_static_roles(launch)
        pd = launch is not None and launch.router.pd_disaggregation
        # A PD router lists its engines from its command line: nodes that join get no engines then.
        elastic = dataclasses.replace(s.elastic, rollout_elastic_resource=None) if static else s.elastic
        manager = EngineManager(
            template=template,
            config=elastic,
            router=None,  # set once its router serves
            say=self.say,
            record=self.record,
            external_router=bool(s.vllm.vllm_router_ip) and not pd,
            static_roles=static,
        )
        return ModelServer(
            self.trained_model or "default",
            manager,
            launch=launch,
            frozen=False,
            log_dir=self.log_dir,
            run_token=self.run_token,
            http_timeout=s.run.http_timeout,
            router_restart_budget=s.elastic.rollout_router_restart_budget,
            say=self.say,
            record=self.record,
        )

    def _start_trained_router(self, router_args: dict) -> None:
        """The trained model's router: vime's own (on --vllm-router-port, if given), or --vllm-router-ip's.
        Its address is the run's main router, ``args.vllm_router_ip`` / ``args.vllm_router_port``."""
        s = self.s
        if s.vllm.vllm_router_ip:
            self.trained.use_external_router(f"http://{s.vllm.vllm_router_ip}:{s.vllm.vllm_router_port or 30000}")
        else:
            self.trained.start_router(router_args, port=s.vllm.vllm_router_port)
        s.args.vllm_router_ip, s.args.vllm_router_port = self.trained.router_url.split("//")[1].rsplit(":", 1)

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

    def _start_trained_engines(self, launch) -> None:
        """The trained model's language engines: --rollout-external-engine-addrs, or the planned ones."""
        s = self.s
        manager = self.trained.manager
        external = getattr(s.args, "rollout_external_engine_addrs", None) or []
        planned = launch.language_engines if launch else ()
        if external:
            self.say(f"attaching {len(external)} external engine(s): {' '.join(external)}")
            manager.attach_external(external)
        elif planned:
            self.say(
                f"starting {len(planned)} vLLM engine(s); waiting up to {s.run.engine_startup_timeout:.0f}s "
                f"for each (logs in {self.log_dir})"
            )
            manager.start_owned(len(planned), variants=engine_variants(planned, s.weights.engine_vllm_args))
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

    def _publish_model_endpoints(self) -> None:
        """get_model_url(args, name) and prime_encoder in rewards, rollout functions and hooks
        (docs/vllm-config.md): {name: (ip, port)} for every model, the trained one included."""
        models = self._models()
        self.s.args.vllm_model_routers = {model.name: model.address for model in models}
        if self.plan is not None:
            encoders = {model.name: model.encoder_urls for model in models}
            self.s.args.vllm_model_encoder_endpoints = self.plan.encoder_endpoints(encoders)

    # ------------------------------------------------------------------ poll
    def poll(self, version: int) -> list[NodeEvent]:
        """Routers, engines and frozen models: restarts, health, membership (never blocks long, but for a
        router's restart: seconds). Returns the node events of the trained model's engines; raises
        EnginesLost (RouterLost included) when a model can no longer serve."""
        if self.trained is None:
            return []
        events = self.trained.poll(version)
        for model in self.frozen_models:
            model.poll(0)
        return events

    def health(self) -> dict[str, Any]:
        """For the step's record and progress line: engines serving, and the engine faults since the last
        step (quarantines, restarts, drops)."""
        if self.trained is None:
            return {}
        manager = self.trained.manager
        serving, total = manager.serving_counts()
        return {"engines_serving": serving, "engines_total": total, "engine_faults": manager.take_notes()}

    def describe_engines(self) -> str:
        """One line naming every engine of the trained model with its state and URL (for errors)."""
        if self.trained is None:
            return ""
        return ", ".join(f"{e['name']} {e['state']} at {e['url']}" for e in self.trained.manager.snapshot()["engines"])

    # ------------------------------------------------------------------ stop
    def end(self) -> None:
        """The run is ending: an engine lost from now on is not restarted."""
        for model in self._models():
            model.end()

    def abort_requests(self) -> None:
        """Requests in flight end now (finish_reason "abort"): their groups go back to the queue as
        continuations carrying what was generated, instead of being waited for. The engines resume at
        once: a request that reaches them later simply completes."""
        if self.trained is not None:
            self.trained.engines.pause("abort")
            self.trained.engines.resume()

    def stop_steps(self) -> list[tuple[str, Callable[[], Any]]]:
        """The teardown's steps for what this serves, in reverse start order, each named for the progress
        output: the trained model's engines, every frozen model, the router, the encoder cache."""
        trained = self.trained
        return [
            ("the engines", lambda: trained and trained.stop_engines()),
            *((f"model {model.name!r}", model.stop) for model in self.frozen_models),
            ("the router", lambda: trained and trained.stop_router()),
            ("the encoder cache", self._remove_encoder_cache),
        ]

    def _remove_encoder_cache(self) -> None:
        """EPD: the embeddings vime's default encoder cache kept in shared memory (docs/vllm-config.md)."""
        if self.plan is not None and self.plan.owned_ec_cache:
            shutil.rmtree(self.plan.owned_ec_cache, ignore_errors=True)
