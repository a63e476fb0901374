"""``vime train``: start every process of a run, drive the training loop, stop everything.

The loop reads like the algorithm. Rollout workers generate continuously in the background; the
driver only waits for enough accepted groups, trains on them, publishes the new weights to every
engine, and commits the step:

    for rollout_id in range(start, num_rollout):
        groups  = controller.take_groups(cursor, rollout_batch_size)  # accepted, by reference
        metrics = trainer.train_rollout(rollout_id, groups)           # advantages, loss, optimizer
        path    = trainer.publish_weights(version + 1)                # weight_v{N}/ on disk
        engines.update_weights(path, version + 1, flush=...)          # every engine, directly
        controller.sync(version + 1, cursor, trained)                 # admission moves on
        checkpoint (model + optimizer + cursor) / commit the queue cursor
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from vime.config import ConfigError, TrainSettings, parse_train_args
from vime.config.vllm import check_against_vllm, check_topology_against_vllm
from vime.data.source import DataError, DataKeys, PromptDataset, open_prompt_source
from vime.metrics import MetricsLog, plot_rewards
from vime.rollout.generate import SamplingParams
from vime.rollout.rewards import resolve_reward
from vime.runtime.plugins import PluginError, absolute_plugin_path, load_hook
from vime.weights.policy import flush_for_sync
from vime.recovery import checkpoint as ckpt
from vime.recovery import faults
from vime.recovery.lineage import Lineage

POLL_SECONDS = 0.05
# A rollout worker's process imports vime, torch and transformers and loads the tokenizer before it opens
# its queue: seconds on an idle machine, over a minute on a loaded one (a node's worker was given up after
# 60 s while the machine ran another job).
WORKER_START_SECONDS = 300.0
MAX_WORKER_RESTARTS = 5


class RunError(RuntimeError):
    """A failure the user can act on; printed as one line (plus any log tail it carries)."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from vime.engines.http import EngineError
    from vime.queue.fence import QueueBusy
    from vime.runtime.ports import PortInUseError
    from vime.workers.trainer_worker import CorruptGroup

    return (ConfigError, CorruptGroup, DataError, PluginError, RunError, EngineError, PortInUseError, QueueBusy,
            ckpt.CheckpointError)


def _unwrap(error: BaseException) -> BaseException:
    """Ray wraps an actor's exception; report the original."""
    cause = getattr(error, "cause", None)
    return _unwrap(cause) if isinstance(cause, BaseException) and cause is not error else error


class TrainingRun:
    def __init__(self, settings: TrainSettings):
        self.s = settings
        self.token = uuid.uuid4().hex
        self.run_dir = settings.run.run_dir
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self.log = MetricsLog(self.run_dir)
        self.router = None
        self.router_client = None
        self.engines = None                 # vime.workers.engines.EngineGroup: the engines that serve
        self.engine_manager = None          # vime.workers.engine_manager.EngineManager (docs/elastic.md)
        self.frozen_models: list = []       # vime.workers.model_servers.FrozenModel: other --vllm-config models
        self.ray_namespace = f"vime-{self.token[:12]}"  # `vime engines` finds the run's registry there
        self.controller = None
        self.trainer = None
        self.weight_sync = None             # vime.workers.engines.WeightSync, built at the first publication
        self.colocation = None              # vime.workers.colocation.ColocatedMemory with --colocate's offload
        self.workers: list = []
        self.first_worker = None            # rollout worker 0's actor, created early, until it is launched
        self.worker_runs: list = []
        self.worker_writers: list = []      # straw writer id of each rollout worker
        self.worker_leases: list = []       # the id each rollout worker leases under (fenced when it dies)
        self.worker_nodes: list = []        # the node a rollout worker was placed on (None: anywhere)
        self.worker_restarts = 0
        self.engine_errors_seen = 0          # the rollout workers' engine_errors at the last step
        self.leftover: list[str] = []        # processes of the run the teardown could not stop
        self.guard = None                    # vime.runtime.incarnations.RunGuard: the reaper and the record
        self.ray_started = False
        self.last_saved_step: int | None = None
        self.version = 0                     # the weight version every engine serves
        self.cursor = 0                      # accepted groups handed to the trainer so far
        self.step_cursors: list[int] = []    # the cursor after each step of this lineage
        self.skipped: list[int] = []         # positions passed over as too stale (prompts regenerated)
        self.lineage = Lineage()             # restores in place: which versions are lost (recovery/lineage.py)
        self.step = 0                        # steps trained in the surviving lineage
        self.restarter = None                # vime.workers.trainer_restart.TrainerRestarter

    # ================================================================== entry
    def run(self) -> int:
        if self.s.debug.load_debug_rollout_data:  # debug replay: recorded batches, no engines (vime/replay.py)
            from vime.replay import replay
            return replay(self.s, self.log)
        try:
            self._guard_processes()
            self._check_inputs()
            self._start_processes()
            start_step, version = self._restore()
            self._reap_dead_producers()
            self.before = self._evaluate(version, step=start_step, label="before training")
            self._start_rollout_workers()
            version = self._train(start_step, version)
            self._finish(version)
            return 0
        finally:
            self._teardown()

    # ================================================================== set-up
    def _guard_processes(self) -> None:
        """Before any process starts: stop what dead runs on this queue left behind, and start the reaper
        that stops this run's processes if the driver dies without its teardown (a SIGKILL, the OOM
        killer). See vime/runtime/reaper.py and vime/runtime/incarnations.py."""
        from vime.runtime.incarnations import RunGuard

        self.guard = RunGuard.start(self.token, data_dir=self.s.rollout_data_dir, run_dir=self.run_dir,
                                    say=self.log.say)

    def _check_inputs(self) -> None:
        s = self.s
        keys = DataKeys(s.data.input_key, s.data.label_key, s.data.metadata_key)
        # -- user hooks: absolute paths (workers may run elsewhere); each is loaded and its signature
        #    checked here, so that a bad path fails before any process starts (vime/runtime/plugins.py) --
        for section, flag in ((s.rollout, "--custom-rm-path"), (s.rollout, "--custom-generate-function-path"),
                              (s.rollout, "--rollout-function-path"), (s.rollout, "--dynamic-sampling-filter-path"),
                              (s.eval, "--eval-function-path"), (s.data, "--data-source-path")):
            name = flag[2:].replace("-", "_")
            setattr(section, name, absolute_plugin_path(getattr(section, name)))
            if getattr(section, name):
                load_hook(flag, getattr(section, name))
        self.dataset = open_prompt_source(s.data.prompt_data, keys, data_source_path=s.data.data_source_path,
                                          args=s.args)
        self.eval_sets = [(name, PromptDataset.load(path, keys)) for name, path in s.eval.datasets]
        # --
        self.reward = resolve_reward(s.rollout.rm_type, s.rollout.custom_rm_path)  # fails early on a bad path
        self._report_megatron_lm_flags()
        self._plan_engines()
        check_against_vllm(s.vllm.vllm_args)
        check_topology_against_vllm(getattr(s.args, "vllm_deployment", None))  # --vllm-config overrides
        if s.queue.rollout_data_transport == "straw":
            from vime.queue.fence import QueueFence

            QueueFence.acquire(s.rollout_data_dir).release()  # a live run on this queue fails us now
            self._check_queue_identity()
        self.resume = None  # (folder, CheckpointState) when resuming
        if s.checkpoint.load:
            if ckpt.latest_step(s.checkpoint.load) is None and s.checkpoint.ckpt_step is None:
                # As the reference framework does: a --load without a checkpoint starts afresh.
                self.log.say(f"--load {s.checkpoint.load} holds no checkpoint yet: starting from --hf-checkpoint")
            else:
                self.resume = ckpt.load_state(s.checkpoint.load, s.checkpoint.ckpt_step)
                ckpt.check_run_options(self.resume[1].run_options, self._run_options())
                if s.queue.rollout_data_transport != "straw":
                    raise ConfigError("--load", "resuming needs the durable queue (--rollout-data-transport straw)")
        from transformers import AutoConfig, AutoTokenizer

        s.megatron.check_against_hf(AutoConfig.from_pretrained(s.train.hf_checkpoint), s.train.train_backend)
        self.tokenizer = AutoTokenizer.from_pretrained(s.train.hf_checkpoint)
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"run_token": self.token, "argv": sys.argv, "pid": os.getpid()}, f)

    def _report_megatron_lm_flags(self) -> None:
        """Say what the Megatron-LM flags passed through do (vime/config/megatron_lm.py): a flag vime's trainer does
        not read reaches user code only, which a user should not have to guess."""
        passthrough = self.s.megatron_lm
        if not passthrough.values:
            return
        from vime.config.megatron_lm import transformer_overrides

        model = transformer_overrides(passthrough) if self.s.train.train_backend == "megatron" else {}
        if model:
            self.log.say("Megatron-LM flags set the model's TransformerConfig: "
                         + ", ".join(passthrough.flags[name] for name in model))
        rest = [flag for name, flag in passthrough.flags.items() if name not in model]
        if rest:
            self.log.say("Megatron-LM flags that vime's trainer does not read (user code sees them in args): "
                         + ", ".join(rest))

    def _plan_engines(self) -> None:
        """What to start, from the resolved topology (vime/config/vllm_config.py): the trained
        model and, with --vllm-config, the others. None with --rollout-external-engine-addrs."""
        from vime.config.vllm_config import build_launch_plan, trained_model_name

        deployment = getattr(self.s.args, "vllm_deployment", None)
        self.plan, self.trained_model = None, None
        if deployment is None:
            return
        self.trained_model = trained_model_name(deployment)
        flag = {"vllm-config": "--vllm-config", "prefill-num-servers": "--prefill-num-servers"}.get(deployment.origin)
        pd = any(group.worker_type in ("prefill", "decode") for model in deployment.models for group in model.groups)
        if pd and self.s.vllm.vllm_router_ip:
            raise ConfigError("--vllm-router-ip", "vime starts the prefill/decode engines of this topology, and a PD "
                              "router learns its engines from its command line: leave --vllm-router-ip out (vime "
                              "starts the router), or start the engines yourself and attach them with "
                              "--rollout-external-engine-addrs")
        self.plan = build_launch_plan(deployment, router_args=self.s.router_args)
        teacher = self.s.algorithm.opd_teacher_model
        if teacher and teacher not in {model.name for model in deployment.models}:
            raise ConfigError("--opd-teacher-model", f"{teacher!r} is not a model of "
                              f"{flag or '--vllm-config'}; models: {', '.join(m.name for m in deployment.models)}")

    @property
    def store_options(self):
        from vime.queue.rollout_queue import StoreOptions

        q = self.s.queue
        return StoreOptions(self.s.rollout_data_dir, q.rollout_queue_run_id, q.rollout_queue_segment_mib,
                            q.rollout_queue_online_gc, q.rollout_storage_profile, q.storage_declaration())

    def _start_processes(self) -> None:
        s = self.s
        self._start_ray()
        self._start_engines()
        import ray

        from vime.workers.controller import Controller, ControllerSpec
        from vime.workers.trainer_group import TrainerGroup
        from vime.workers.trainer_worker import TrainerWorkerSpec

        self.log.say(f"opening the {s.queue.rollout_data_transport} queue"
                     + (f" in {s.rollout_data_dir}" if s.queue.rollout_data_transport == "straw" else ""))
        controller_spec = ControllerSpec(
            transport=s.queue.rollout_data_transport, store=self.store_options,
            lease_seconds=s.queue.rollout_queue_lease_seconds, prompt_data=s.data.prompt_data,
            keys=DataKeys(s.data.input_key, s.data.label_key, s.data.metadata_key), seed=s.run.seed,
            shuffle=s.data.rollout_shuffle, num_epoch=s.data.num_epoch,
            groups_per_rollout=s.rollout.rollout_batch_size, max_staleness=s.max_staleness,
            data_source_path=s.data.data_source_path, args=s.args)
        # The controller is restartable: a new incarnation recovers the queue from its journal (every
        # lease of the old one fenced) and calls in flight are retried against it.
        self.controller = ray.remote(num_cpus=0, max_restarts=10, max_task_retries=-1,
                                     name=Controller.ACTOR_NAME)(Controller).remote(controller_spec)
        threads, affinity = self._trainer_cpus()
        trainer_spec = TrainerWorkerSpec.from_settings(s, transport=s.queue.rollout_data_transport,
                                                       store=self.store_options, threads=threads,
                                                       cpu_affinity=affinity)
        ranks = s.cluster.num_trainers
        self.log.say(f"starting the trainer ({s.train.train_backend} backend, "
                     + (f"{ranks} ranks, " if ranks > 1 else "") + f"{threads} thread(s)"
                     + (" each)" if ranks > 1 else ")"))
        self.trainer = TrainerGroup.start(trainer_spec, ranks, gpus_per_rank=self._trainer_gpus_per_rank(),
                                          timeout=600)
        # The first rollout worker's process starts (imports, tokenizer, hooks) while the trainer does; it
        # opens its queue writer and generates only after recovery (_start_rollout_workers).
        self.first_worker = self._create_worker(0)
        ready = ray.get([self.controller.ready.remote(), self.trainer.leader.ready.remote()], timeout=600)
        self.log.say(f"controller ready: {ready[0]['accepted']} accepted group(s) in the queue, "
                     f"{ready[0]['consumed']} trained")

    def _trainer_cpus(self) -> tuple[int, list[int] | None]:
        """(torch threads, cores) for the trainer on a CPU-only single node.

        vLLM's CPU engine binds its compute threads to the first cores (one per engine by default);
        the trainer gets the cores after them, one thread each. Attached to a Ray cluster, or with
        --train-threads, vime leaves placement alone.
        """
        s = self.s
        if s.train.train_threads or s.cluster.ray_address:
            return s.train.train_threads or 1, None
        cores = sorted(os.sched_getaffinity(0))
        spare = cores[s.cluster.num_engines * s.cluster.rollout_num_gpus_per_engine:]
        if not spare:
            return 1, None
        # Ranks share the spare cores (each rank's threads compete with the others' otherwise).
        return max(1, len(spare) // s.cluster.num_trainers), spare

    def _trainer_gpus_per_rank(self) -> float:
        """One GPU per rank when several Megatron ranks train on GPUs (Ray then shows each its own);
        a single rank keeps today's placement (it uses the node's first GPU, beside the engines)."""
        import ray

        s = self.s
        if s.cluster.num_trainers == 1 or s.train.train_backend != "megatron":
            return 0
        return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0

    def _start_ray(self) -> None:
        import ray

        os.environ["VIME_RUN_TOKEN"] = self.token  # every process started below inherits it
        # Ray's workers retitle themselves ("ray::TrainerWorker.train_rollout") with setproctitle's code,
        # which would otherwise overwrite the memory /proc/PID/environ reads, hiding the token from the
        # sweeps (the teardown's, the reaper's: vime/runtime/reaper.py).
        os.environ["SPT_NOENV"] = "1"
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.s.cluster.ray_address:
            self.log.say(f"attaching to the Ray cluster at {self.s.cluster.ray_address}")
            ray.init(address=self.s.cluster.ray_address, log_to_driver=self.s.run.log_level == "debug",
                     namespace=self.ray_namespace)
        else:
            self.log.say("starting Ray (in-process)")
            # address="local": always a cluster of our own, never one someone else started here.
            ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False,
                     _node_ip_address="127.0.0.1",
                     log_to_driver=self.s.run.log_level == "debug", configure_logging=False,
                     namespace=self.ray_namespace)
        self.ray_started = True
        # `vime engines --run RUN_DIR` attaches to this Ray cluster and namespace (docs/elastic.md).
        self._update_run_json(ray_address=ray.get_runtime_context().gcs_address, ray_namespace=self.ray_namespace)

    def _update_run_json(self, **fields) -> None:
        path = os.path.join(self.run_dir, "run.json")
        with open(path) as f:
            info = json.load(f)
        info.update(fields)
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)

    def _start_router(self, router_args: dict) -> None:
        """The trained model's router (vime's own, or --vllm-router-ip); every other model of
        --vllm-config gets its own (workers/model_servers.py)."""
        from vime.engines.router import RouterClient, start_router

        s = self.s
        if s.vllm.vllm_router_ip:
            port = s.vllm.vllm_router_port or 30000
            self.router_url = f"http://{s.vllm.vllm_router_ip}:{port}"
            self.log.say(f"using the external router at {self.router_url}")
        else:
            self.router = start_router(log_path=os.path.join(self.run_dir, "logs", "router.log"),
                                       run_token=self.token, router_args=router_args,
                                       port=s.vllm.vllm_router_port, say=self.log.say)
            self.router_url = self.router.url
        self.router_client = RouterClient(self.router_url, timeout=s.run.http_timeout)
        s.args.vllm_router_ip, s.args.vllm_router_port = self.router_url.split("//")[1].rsplit(":", 1)

    def _start_engines(self) -> None:
        """Every model's router and engines in the order their roles need (workers/model_servers.py):
        the trained model's (vime's own, or --rollout-external-engine-addrs) with the engine registry
        `vime engines` talks to and the health monitor (workers/engine_manager.py), and the other
        models of --vllm-config, whose engines start at the same time."""
        from vime.workers.model_servers import pd_router_args, start_encoders

        s = self.s
        launch = self.plan.model(self.trained_model) if self.plan else None
        pd = launch is not None and launch.router.pd_disaggregation
        if not pd:  # regular engines register with their router once they serve: it starts first
            self._start_router(launch.router.router_args if launch else s.router_args)
        template = self._engine_template()
        self._make_engine_manager(template, launch, pd=pd)
        started = time.monotonic()
        encoders = {launch.name: start_encoders(self.engine_manager, launch, s.weights.engine_vllm_args)} if launch else {}
        self._start_frozen_models(template)  # their language engines start while the trained model's do
        self._start_trained_engines(launch)
        if pd:  # a PD router learns its engines from its command line: they serve by now
            self._start_router(pd_router_args(launch, self.engine_manager))
            self.engine_manager.router = self.router_client
        if len(self.engines):
            self.log.say(f"{len(self.engines)} engine(s) serving after {time.monotonic() - started:.0f}s behind the "
                         f"router {self.router_url}: {', '.join(self.engines.urls)}")
        self.engine_manager.open_registry(self.ray_namespace)
        self.engine_manager.start_monitor()
        for model in self.frozen_models:
            model.wait_serving()
            encoders[model.name] = model.encoder_urls
            self.log.say(f"model {model.name!r}: {len(model.manager.group)} engine(s) serving behind its router "
                         f"{model.router.url}")
        self._publish_model_endpoints(encoders)

    def _engine_template(self):
        """What every engine of the trained model starts from (frozen models take it with their own path)."""
        from vime.workers.engine_manager import EngineTemplate

        s = self.s
        return EngineTemplate(
            model=s.train.hf_checkpoint, vllm_args=s.weights.engine_vllm_args(s.vllm.vllm_args),
            tensor_parallel_size=s.cluster.rollout_num_gpus_per_engine, run_token=self.token,
            log_dir=os.path.join(self.run_dir, "logs"), startup_timeout=s.run.engine_startup_timeout,
            http_timeout=s.run.http_timeout, weight_dir=s.weight_dir,
            weight_transport=s.weights.update_weight_transport, sleep_mode=bool(s.rollout_sleep_level))

    def _make_engine_manager(self, template, launch, *, pd: bool) -> None:
        import dataclasses

        from vime.workers.engine_manager import EngineManager
        from vime.workers.model_servers import has_static_roles

        s = self.s
        static = launch is not None and has_static_roles(launch)
        # A PD router lists its engines from its command line: nodes that join get no engines then.
        elastic = dataclasses.replace(s.elastic, rollout_elastic_resource=None) if static else s.elastic
        self.engine_manager = EngineManager(template=template, config=elastic, router=self.router_client,
                                            say=self.log.say, record=self.log.write,
                                            external_router=self.router is None and not pd, static_roles=static)
        self.engines = self.engine_manager.group

    def _start_trained_engines(self, launch) -> None:
        """The trained model's language engines: --rollout-external-engine-addrs, or the planned ones."""
        from vime.workers.model_servers import engine_variants

        s = self.s
        external = getattr(s.args, "rollout_external_engine_addrs", None) or []
        planned = launch.language_engines if launch else ()
        if external:
            self.log.say(f"attaching {len(external)} external engine(s): {' '.join(external)}")
            self.engine_manager.attach_external(external)
        elif planned:
            self.log.say(f"starting {len(planned)} vLLM engine(s); waiting up to {s.run.engine_startup_timeout:.0f}s "
                         f"for each (logs in {os.path.join(self.run_dir, 'logs')})")
            self.engine_manager.start_owned(len(planned), variants=engine_variants(planned, s.weights.engine_vllm_args))
        else:
            self.log.say("--rollout-num-gpus 0: no local engines")

    def _publish_model_endpoints(self, encoders: dict[str, list[str]]) -> None:
        """get_model_url(args, name) and prime_encoder in rewards, rollout functions and hooks
        (docs/vllm-config.md)."""
        routers = {self.trained_model or "default": self.router_url}
        routers.update({model.name: model.address for model in self.frozen_models})
        self.s.args.vllm_model_routers = routers
        if self.plan is not None:
            self.s.args.vllm_model_encoder_endpoints = self.plan.encoder_endpoints(encoders)

    def _start_frozen_models(self, template) -> None:
        """Start (waiting only for encoders) every model of --vllm-config besides the trained one."""
        from vime.workers.model_servers import start_frozen_model

        s = self.s
        for launch in self.plan.models if self.plan else ():
            if launch.name != self.trained_model:
                self.frozen_models.append(start_frozen_model(
                    launch, template=template, elastic=s.elastic, log_dir=os.path.join(self.run_dir, "logs"),
                    run_token=self.token, http_timeout=s.run.http_timeout, say=self.log.say, record=self.log.write))

    def _poll_engines(self) -> None:
        """Membership changes (health, restarts, `vime engines`, nodes that join or leave); a new
        node's rollout worker starts once its first engine serves the current weights."""
        from vime.workers.engine_manager import EnginesLost

        if self.engine_manager is None:
            return
        try:
            events = self.engine_manager.poll(self.version)
            for model in self.frozen_models:
                model.poll()
        except EnginesLost as error:
            raise RunError(str(error)) from None
        for event in events:
            if event.kind == "ready" and self.controller is not None and self.workers:
                index = len(self.workers)
                self._launch_worker(index, node_id=event.node_id)
                if index < len(self.workers):
                    self.log.say(f"rollout worker {index} generating on node {event.node_id[:12]}")

    def _engine_health(self) -> dict[str, Any]:
        """For the step's record and progress line: engines serving, the engine faults since the last step
        (quarantines, restarts, drops) and the generate requests that engines failed meanwhile (each
        sent its group back to the queue; no attempt of the prompt was spent)."""
        import ray

        health: dict[str, Any] = {}
        if self.engine_manager is not None:
            serving, total = self.engine_manager.serving_counts()
            health.update(engines_serving=serving, engines_total=total,
                          engine_faults=self.engine_manager.take_notes())
        try:
            stats = ray.get([worker.get_stats.remote() for worker in self.workers], timeout=10)
        except (ray.exceptions.RayError, TimeoutError):  # a dead worker: _check_workers deals with it
            return health
        errors = sum(s.engine_errors for s in stats)
        health["rollout_engine_errors"] = max(0, errors - self.engine_errors_seen)  # a new worker counts from 0
        if health["rollout_engine_errors"] > 0:
            health["rollout_last_engine_error"] = next((s.last_engine_error for s in stats if s.last_engine_error), "")
        self.engine_errors_seen = errors
        return health

    def _check_queue_identity(self) -> None:
        """An existing queue keeps the identity it was created with (straw refuses to recover it
        otherwise): say which flag differs instead."""
        path = os.path.join(self.s.rollout_data_dir, "run.json")
        if not os.path.exists(path):
            return
        with open(path) as f:
            identity = json.load(f)
        q = self.s.queue
        for flag, created, now in (("--rollout-queue-run-id", identity.get("run_id"), q.rollout_queue_run_id),
                                   ("--rollout-queue-lease-seconds", identity.get("lease_seconds"),
                                    q.rollout_queue_lease_seconds),
                                   ("--rollout-storage-profile", identity.get("profile"), q.rollout_storage_profile)):
            if created is not None and created != now:
                raise ConfigError(flag, f"the queue in {self.s.rollout_data_dir} was created with {created!r}, "
                                        f"this run has {now!r}; keep it, or use another --rollout-data-dir")

    def _run_options(self) -> dict[str, Any]:
        s = self.s
        return {"prompt_data": s.data.prompt_data, "n_samples_per_prompt": s.rollout.n_samples_per_prompt,
                "rollout_queue_run_id": s.queue.rollout_queue_run_id, "seed": s.run.seed,
                "rollout_batch_size": s.rollout.rollout_batch_size, "input_key": s.data.input_key,
                "label_key": s.data.label_key, "rollout_shuffle": s.data.rollout_shuffle}

    def _restore(self) -> tuple[int, int]:
        """(first rollout id, weight version) — from the checkpoint when resuming."""
        import ray

        if self.resume is None:
            return 0, 0
        folder, state = self.resume
        self.log.say(f"resuming from {folder}: step {state.step}, weight version {state.weight_version}, "
                     f"{state.consumer_cursor} group(s) trained")
        if not ray.get(self.controller.history_available.remote(state.consumer_cursor)):
            raise RunError(f"the accepted groups after step {state.step} were reclaimed by "
                           "--rollout-queue-online-gc; only the latest checkpoint can be resumed "
                           f"(see {ckpt.LATEST} in {self.s.checkpoint.load})")
        self.trainer.run("load_checkpoint", folder, timeout=3600, what=f"loading {folder}")
        # The checkpoint's cursor is authoritative: the queue's committed cursor may lag behind it
        # (a crash between the two writes) and may be ahead of it (resuming an older --ckpt-step).
        self.cursor, self.step_cursors = state.consumer_cursor, list(state.step_cursors)
        self.skipped = list(state.skipped)
        self.lineage = state.lineage
        self._publish(state.weight_version, sync_number=1)
        return state.step, state.weight_version

    def _reap_dead_producers(self) -> None:
        """Publications left unaccepted by producers of an earlier (dead) incarnation."""
        import ray

        report = ray.get(self.controller.reap_writers.remote([]))
        if report.get("publications_released"):
            self.log.say(f"released {report['publications_released']} orphaned publication(s) of "
                         f"{report['writers_retired']} dead producer(s)")

    # ================================================================== rollout and training
    def _rollout_spec(self, index: int):
        from vime.workers.rollout_worker import RolloutWorkerSpec

        s = self.s
        return RolloutWorkerSpec(
            worker_id=f"rollout-{index}-{uuid.uuid4().hex[:6]}", router_url=self.router_url,
            hf_checkpoint=s.train.hf_checkpoint, transport=s.queue.rollout_data_transport,
            store=self.store_options, n_samples_per_prompt=s.rollout.n_samples_per_prompt,
            sampling=self._sampling(), max_concurrent_groups=s.rollout.max_concurrent_groups,
            partial_rollout=s.rollout.partial_rollout, apply_chat_template=s.data.apply_chat_template,
            rm_type=s.rollout.rm_type, custom_rm_path=s.rollout.custom_rm_path,
            custom_generate_function_path=s.rollout.custom_generate_function_path,
            rollout_function_path=s.rollout.rollout_function_path,
            dynamic_sampling_filter_path=s.rollout.dynamic_sampling_filter_path,
            request_timeout=s.rollout.rollout_request_timeout, lease_seconds=s.queue.rollout_queue_lease_seconds,
            args=s.args)

    def _sampling(self) -> SamplingParams:
        r, a = self.s.rollout, self.s.algorithm
        # Score centering: the rollout records the sampler's heads or top-p supports (never at evaluation).
        return SamplingParams(max_new_tokens=r.rollout_max_response_len, temperature=r.rollout_temperature,
                              top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                              score_centering_top_k=a.score_centering_top_k if a.use_score_centering else 0,
                              routing_replay=self.s.megatron.use_rollout_routing_replay)

    def _start_rollout_workers(self) -> None:
        self.workers, self.worker_runs, self.worker_writers = [], [], []
        self.worker_leases, self.worker_nodes = [], []
        self.worker_restarts = 0
        worker, self.first_worker = self.first_worker, None
        self._launch_worker(0, worker=worker)
        self.log.say(f"{len(self.workers)} rollout worker(s) generating")

    def _create_worker(self, index: int, node_id: str | None = None):
        """Rollout worker ``index``'s actor (anywhere, or on ``node_id``), its queue not opened yet."""
        import ray

        from vime.workers.rollout_worker import RolloutWorker

        options = {}
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return ray.remote(num_cpus=0)(RolloutWorker).options(**options).remote(self._rollout_spec(index),
                                                                              self.controller)

    def _launch_worker(self, index: int, node_id: str | None = None, worker=None) -> None:
        """Start rollout worker ``index`` (anywhere, or on ``node_id``: a node that joined; a
        worker that cannot start there within WORKER_START_SECONDS is given up, its node's engines stay).
        ``worker``: its actor, already created by :meth:`_create_worker`."""
        import ray

        if worker is None:
            worker = self._create_worker(index, node_id)
        try:
            identity = ray.get(worker.open_queue.remote(), timeout=WORKER_START_SECONDS)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as error:
            if node_id is None:
                raise
            ray.kill(worker)
            self.log.say(f"rollout worker {index} could not start on node {node_id[:12]}: {error}")
            if index < len(self.workers):  # a replacement: the dead worker's entry goes
                for items in (self.workers, self.worker_runs, self.worker_writers, self.worker_leases,
                              self.worker_nodes):
                    del items[index]
            return
        run = worker.run.remote()
        entry = (worker, run, identity["writer_id"], identity["lease_id"], node_id)
        lists = (self.workers, self.worker_runs, self.worker_writers, self.worker_leases, self.worker_nodes)
        for items, value in zip(lists, entry):
            if index < len(items):
                items[index] = value
            else:
                items.append(value)

    def _check_workers(self) -> None:
        """A rollout worker whose process died is replaced (its leases are fenced at once, so its
        tasks return to the queue; its unaccepted publications are released); one whose node left
        the cluster is not; one whose code failed fails the run."""
        import ray

        done, _ = ray.wait(self.worker_runs, timeout=0)
        for ref in done:
            index = self.worker_runs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as error:
                ray.get(self.controller.retire_worker.remote(self.worker_leases[index]), timeout=60)
                node = self.worker_nodes[index]
                if node is not None and not any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes()):
                    for items in (self.workers, self.worker_runs, self.worker_writers, self.worker_leases,
                                  self.worker_nodes):
                        del items[index]
                    self.log.say(f"rollout worker {index} left with its node {node[:12]}; its leases were fenced "
                                 "and its tasks returned to the queue")
                else:
                    self.worker_restarts += 1
                    if self.worker_restarts > MAX_WORKER_RESTARTS:
                        raise RunError(f"rollout workers died {self.worker_restarts} times; last: {error}") from None
                    self.log.say(f"rollout worker {index} died; starting a new one "
                                 f"({self.worker_restarts}/{MAX_WORKER_RESTARTS})")
                    self._launch_worker(index, node_id=node)
                report = ray.get(self.controller.reap_writers.remote([w for w in self.worker_writers if w]), timeout=120)
                self.log.say(f"released {report.get('publications_released', 0)} unaccepted publication(s) "
                             "of the dead worker")
                continue
            raise RunError(f"rollout worker {index} stopped unexpectedly")

    @property
    def trained(self) -> int:
        """Accepted groups trained in this lineage (the cursor minus those skipped as stale)."""
        return self.cursor - len(self.skipped)

    def _wait_for_groups(self, count: int, step: int):
        import ray

        last_accepted, last_progress = None, time.monotonic()
        while True:
            _raise_if_interrupted()
            self._poll_engines()  # engine membership and health (docs/elastic.md); never blocks long
            if faults.held("driver.before_step", step):  # a test keeps the run open until its event happened
                self._check_workers()
                last_progress = time.monotonic()
                time.sleep(POLL_SECONDS)
                continue
            taken = ray.get(self.controller.take_groups.remote(self.cursor, count, self.version, self.trained,
                                                               lineage=self.lineage))
            if taken.groups:
                return taken
            self._check_workers()
            stats = ray.get(self.controller.stats.remote())
            if stats.end_of_data:
                # The prompts are exhausted: the last step trains whatever was accepted.
                taken = ray.get(self.controller.take_groups.remote(self.cursor, count, self.version, self.trained,
                                                                   allow_partial=True, lineage=self.lineage))
                if taken.groups:
                    return taken
                if taken.skipped:  # only stale groups were left: their prompts are being regenerated
                    self.cursor = taken.next_cursor
                    self.skipped.extend(taken.skipped)
                    continue
                raise StopIteration
            if stats.accepted != last_accepted:
                last_accepted, last_progress = stats.accepted, time.monotonic()
            elif time.monotonic() - last_progress > self.s.rollout.rollout_request_timeout * 2 + 60:
                details = ray.get(self.workers[0].get_stats.remote()) if self.workers else None
                engines = ", ".join(f"{e['name']} {e['state']} at {e['url']}" for e in
                                    self.engine_manager.snapshot()["engines"]) if self.engine_manager else ""
                raise RunError(f"no group was accepted for {time.monotonic() - last_progress:.0f}s "
                               f"(queue: {stats}); rollout worker: {details}; engines: {engines or 'none'}; "
                               f"engine logs are in {os.path.join(self.run_dir, 'logs')}")
            time.sleep(POLL_SECONDS)

    def _publish(self, version: int, *, sync_number: int) -> float:
        import ray

        started = time.monotonic()
        # -- weight synchronisation (vime.workers.engines.WeightSync; docs/weights.md) --
        if self.weight_sync is None:
            from vime.workers.engines import WeightSync

            self.weight_sync = WeightSync(self.trainer, self.engines, self.s.weights)
        flush = flush_for_sync(sync_number, self.s.weights.flush_cache_interval)
        with self.engine_manager.updating() if self.engine_manager else contextlib.nullcontext():
            report = self.weight_sync.sync(version, flush=flush)
        self.log.write({"kind": "weight_sync", **report})
        # --
        self.version = version
        ray.get(self.controller.sync.remote(version, self.cursor, self.trained, self.lineage))
        return time.monotonic() - started

    def _colocated_memory(self):
        """The engines' and the trainer's turns with the GPUs' memory (--colocate; workers/colocation.py)."""
        from vime.workers.colocation import ColocatedMemory, OffloadPlan

        plan = OffloadPlan.from_settings(self.s)
        if plan.active:
            self.log.say(f"colocated memory: the engines sleep (level {plan.sleep_level}) while the trainer trains, "
                         f"the trainer offloads while they generate" if plan.sleep_level and plan.offload_train else
                         f"colocated memory: sleeping engines {bool(plan.sleep_level)}, offloaded trainer "
                         f"{plan.offload_train}")
        self.colocation = ColocatedMemory(plan, trainer=self.trainer, engines=self.engines,
                                          health=self.engine_manager.updating if self.engine_manager else None)
        return self.colocation

    def _train(self, start_step: int, version: int) -> int:
        import ray

        from vime.workers.trainer_group import TrainerDied
        from vime.workers.trainer_restart import TrainerStepFailed

        assert version == self.version  # what every engine serves; _publish keeps it from now on
        s = self.s
        batch = s.rollout.rollout_batch_size
        sync_number = 1 if self.resume else 0  # the restore already published once
        # Rollout throughput over the last few steps: accepted tokens arrive in bursts.
        window = collections.deque([(time.monotonic(), ray.get(self.controller.stats.remote()).accepted_response_tokens)],
                                   maxlen=6)
        self.log.say(f"training: {s.train.num_rollout - start_step} rollout(s) of {batch} group(s) x "
                     f"{s.rollout.n_samples_per_prompt} sample(s)")
        colocation = self._colocated_memory()
        colocation.after_weight_update()  # the engines serve the first version: the trainer makes room
        self.restarter = self._trainer_restarter()
        rollout_id = self.step = start_step
        while rollout_id < s.train.num_rollout:
            _raise_if_interrupted()
            try:
                taken = self._wait_for_groups(batch, rollout_id + 1)
            except StopIteration:
                self.log.say(f"--num-epoch {s.data.num_epoch} exhausted the prompts after {rollout_id} rollout(s)")
                break
            try:
                metrics = self._train_step(rollout_id, taken, colocation, sync_number=sync_number + 1)
            except (TrainerDied, TrainerStepFailed) as error:  # restored in place, or the run stops
                rollout_id = self._restart_trainer(error, rollout_id + 1, colocation)
                sync_number = 1  # the restore published once, flushing
                continue
            sync_number += 1
            rollout_id = step = self.step = rollout_id + 1
            version = self.version
            stats = ray.get(self.controller.stats.remote())
            now = time.monotonic()
            step_seconds = now - window[-1][0]
            window.append((now, stats.accepted_response_tokens))
            record = {"kind": "train", "step": step, "weight_version": version, **metrics,
                      "rollout_tokens_per_s": (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]),
                      "train_tokens_per_s": metrics["train_tokens"] / max(metrics["train_seconds"], 1e-9),
                      "queue_depth": stats.queue_depth, "queue_pending": stats.pending,
                      "queue_leased": stats.leased, "queue_filtered": stats.rejected, "step_seconds": step_seconds,
                      "queue_reclaimed_bytes": stats.reclaimed_bytes,
                      "groups_regenerated": len(taken.skipped), "queue_failed": stats.failed,
                      **self._engine_health()}
            self.log.write(record)
            self.log.progress(record, s.train.num_rollout)
            if s.eval.eval_interval and step % s.eval.eval_interval == 0 and step < s.train.num_rollout:
                self._evaluate(version, step=step, label=f"step {step}")
        return self.version

    def _train_step(self, rollout_id: int, taken, colocation, *, sync_number: int) -> dict[str, Any]:
        """Train on ``taken``, publish the new weights, checkpoint or commit: the trainer's part of a step
        (what a trainer restored in place redoes). Returns the step's metrics."""
        import ray

        from vime.workers.trainer_restart import TrainerStepFailed

        s, step = self.s, rollout_id + 1
        colocation.before_training()
        try:
            metrics = self.trainer.train_rollout(rollout_id, taken.groups, self.version, self.lineage)
        except ray.exceptions.RayTaskError as error:
            if isinstance(_unwrap(error), _user_errors()):
                raise  # the user's to fix: it would fail again after a restart
            raise TrainerStepFailed(f"{type(_unwrap(error)).__name__}: {_unwrap(error)}") from error
        if s.debug.save_debug_rollout_data:  # debug replay: archive the batch just trained (vime/replay.py)
            from vime.replay import save_trained_batch
            save_trained_batch(self, rollout_id, taken.groups, self.version, metrics)
        self.cursor = taken.next_cursor
        self.skipped.extend(taken.skipped)
        self.step_cursors.append(self.cursor)
        metrics["weight_sync_seconds"] = self._publish(self.version + 1, sync_number=sync_number)
        colocation.after_weight_update()
        if s.checkpoint.save and s.checkpoint.save_interval and step % s.checkpoint.save_interval == 0:
            self._save(step, self.version)
        elif not s.checkpoint.save:
            ray.get(self.controller.commit.remote(step, self.cursor, self.step_cursors, self.skipped))
        return metrics

    def _trainer_restarter(self):
        from vime.workers.trainer_restart import TrainerRestarter

        return TrainerRestarter(self.trainer, budget=self.s.checkpoint.trainer_restart_budget,
                                save_dir=self.s.checkpoint.save, resumed=self.resume)

    def _restart_trainer(self, error: Exception, step: int, colocation) -> int:
        """The trainer died during ``step`` (or failed inside it, not by the user's fault): restore it in place
        from the lineage's latest checkpoint while generation goes on (workers/trainer_restart.py), or stop the
        run when --trainer-restart-budget is spent. Returns the rollout id to go on from."""
        from vime.workers.trainer_group import TrainerDied
        from vime.workers.trainer_restart import RestartCause, restart_cause

        restarter = self.restarter
        cause = restart_cause(error)
        started = time.monotonic()
        while True:
            if restarter.spent:
                raise self._trainer_lost(error, step, cause)
            first_line = (str(error).strip().splitlines() or [""])[0]
            self.log.say(f"the trainer {cause.value} during step {step} ({first_line}); restarting it in place "
                         f"({restarter.used + 1}/{restarter.budget} of --trainer-restart-budget) while generation "
                         "goes on")
            try:
                restored = restarter.restore(self.last_saved_step)
                version = self._serve_restored(restored, colocation)
                break
            except TrainerDied as again:  # it died again while being restored: that is one more restart
                error, cause = again, RestartCause.DIED
        self.step = restored.step
        seconds = time.monotonic() - started
        self.log.write({"kind": "trainer_restart", "step": step, "cause": cause.value, "error": str(error)[:2000],
                        "restored_step": restored.step, "checkpoint": restored.folder, "weight_version": version,
                        "lost_versions": [restored.weight_version + 1, version - 1], "seconds": round(seconds, 3),
                        "restarts": restarter.used, "budget": restarter.budget})
        self.log.say(f"trainer restored in {seconds:.1f}s from "
                     + (restored.folder or "the initial weights (no checkpoint yet)")
                     + f": step {restored.step}, serving as weight version {version} (versions "
                     f"{restored.weight_version + 1}..{version - 1} are lost; groups carrying them are generated "
                     "again)")
        return restored.step

    def _serve_restored(self, restored, colocation) -> int:
        """Rewind to what the restored trainer holds and publish it to the engines; returns its new version."""
        import ray

        from vime.weights.disk import published_versions

        if not ray.get(self.controller.history_available.remote(restored.consumer_cursor)):
            raise RunError(f"the trainer cannot be restored to step {restored.step}: the accepted groups after it "
                           "were reclaimed by --rollout-queue-online-gc") from None
        # Back to the restored step's cursor: the groups accepted after it are trained again (those that carry
        # tokens of lost versions are not: their prompts run again, recovery/lineage.py).
        self.cursor, self.step_cursors, self.skipped = (restored.consumer_cursor, restored.step_cursors,
                                                        restored.skipped)
        # Versions only ever increase: one the dead trainer wrote but no engine loaded is lost too, and so is
        # one an earlier attempt of this restore gave out.
        version = 1 + max([self.version, *published_versions(self.s.weight_dir),
                           *(r.version for r in self.lineage.restores)])
        self.lineage = self.lineage.restored(step=restored.step, restored_version=restored.weight_version,
                                             new_version=version)
        if self.weight_sync is not None:
            self.weight_sync.trainer_restarted()
        self._publish(version, sync_number=1)  # flushes: requests in flight run on weights that are lost
        colocation.after_weight_update()
        return version

    def _trainer_lost(self, error: Exception, step: int, cause) -> Exception:
        """The error that stops the run when the trainer cannot be restored (any more)."""
        from vime.workers.trainer_restart import RestartCause

        s, budget = self.s, self.restarter.budget
        if cause is RestartCause.INTERNAL_ERROR:
            return error.__cause__ or error  # an internal error: reported as before
        where = f"resume with --load {s.checkpoint.save}" if s.checkpoint.save else "run again"
        spent = (f" It was restarted in place {budget} time(s): --trainer-restart-budget {budget} is spent."
                 if budget else "")
        return RunError(f"the trainer process died during step {step}; its state since the last checkpoint is "
                        f"lost; {where} (no accepted sample is lost).{spent} Cause: {error}")

    # ================================================================== evaluation and the end
    def _evaluate(self, version: int, *, step: int, label: str) -> dict[str, float]:
        from vime.rollout.evaluate import evaluate_dataset

        s = self.s
        results = {}
        params = SamplingParams(max_new_tokens=s.eval.eval_max_response_len or s.rollout.rollout_max_response_len,
                                temperature=s.eval.eval_temperature, top_p=1.0 if s.eval.eval_temperature == 0
                                else s.rollout.rollout_top_p, top_k=-1)
        for name, dataset in self.eval_sets:
            started = time.monotonic()
            result = asyncio.run(evaluate_dataset(
                dataset, tokenizer=self.tokenizer, router_url=self.router_url, reward=self.reward, args=s.args,
                params=params, n_samples=s.eval.n_samples_per_eval_prompt,
                apply_chat_template=s.data.apply_chat_template, timeout=s.rollout.rollout_request_timeout,
                name=name, rollout_id=step, eval_function_path=s.eval.eval_function_path))
            results[name] = result["reward"]
            self.log.write({"kind": "eval", "step": step, "weight_version": version, "dataset": name,
                            "eval_reward": result["reward"], "eval_response_length": result["response_length"]})
            self.log.say(f"held-out reward on {name!r} {label} (weight version {version}): {result['reward']:.3f} "
                         f"({int(result['samples'])} samples, {time.monotonic() - started:.1f}s)")
        return results

    def _save(self, step: int, version: int) -> None:
        import ray

        state = ckpt.CheckpointState(schema=1, step=step, weight_version=version, consumer_cursor=self.cursor,
                                     run_options=self._run_options(), step_cursors=list(self.step_cursors),
                                     skipped=list(self.skipped), lineage=self.lineage)
        folder = ckpt.save_checkpoint(self.s.checkpoint.save, state,
                                      lambda path: self.trainer.run("save_checkpoint", path, timeout=3600,
                                                                    what=f"saving {path}"))
        ray.get(self.controller.commit.remote(step, self.cursor, self.step_cursors, self.skipped))
        self.last_saved_step = step
        self.log.say(f"saved {folder}")

    def _stop_rollout_workers(self) -> None:
        import ray

        if not self.workers:
            return
        if self.engine_manager is not None:
            self.engine_manager.ending = True  # the run is ending: an engine lost now is not restarted
        for model in self.frozen_models:
            model.manager.ending = True
        for worker in self.workers:
            try:
                ray.get(worker.stop.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # already dead: its leases expire or are fenced
        if self.engines is not None:
            # Requests in flight end now (finish_reason "abort"): their groups go back to the queue
            # as continuations carrying what was generated, instead of being waited for. The
            # engines resume at once: a request that reaches them later simply completes.
            self.engines.pause("abort")
            self.engines.resume()
        done, _ = ray.wait(self.worker_runs, num_returns=len(self.worker_runs),
                           timeout=self.s.rollout.rollout_request_timeout + 60)
        for index, ref in enumerate(self.worker_runs):  # what each worker contributed (docs/elastic.md)
            if ref in done:
                try:
                    stats = ray.get(ref)
                except ray.exceptions.RayError:
                    continue
                self.log.write({"kind": "rollout_worker", "worker": index, "node_id": self.worker_nodes[index]
                                if index < len(self.worker_nodes) else None,
                                "groups_accepted": stats.groups_accepted, "groups_yielded": stats.groups_yielded,
                                "response_tokens": stats.response_tokens, "errors": stats.errors})
        self.workers, self.worker_runs = [], []

    def _finish(self, version: int) -> None:
        import ray

        s = self.s
        self._stop_rollout_workers()
        after = self._evaluate(version, step=self.step, label="after training")
        for name, before in self.before.items():
            self.log.say(f"held-out reward on {name!r}: {before:.3f} -> {after[name]:.3f}")
        if s.checkpoint.save and self.last_saved_step != self.step:
            self._save(self.step, version)  # a restore in place publishes a version that is no step
        if s.checkpoint.save_hf:
            path = os.path.join(self.run_dir, "hf_final")
            self.trainer.run("save_hf", path, timeout=3600, what=f"saving {path}")
            self.log.say(f"final model: {path}")
        png = plot_rewards(self.log.path, os.path.join(self.run_dir, "reward_curve.png"))
        self.log.say(f"metrics: {self.log.path}; reward curve: {png}")
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump({"weight_version": version, "eval_before": self.before, "eval_after": after}, f, indent=1)

    def _kill_unlaunched_worker(self) -> None:
        """A run that fails between creating the first rollout worker and launching it stops that actor too."""
        if self.first_worker is not None:
            import ray

            ray.kill(self.first_worker)

    def _remove_encoder_cache(self) -> None:
        """EPD: the embeddings vime's default encoder cache kept in shared memory (docs/vllm-config.md)."""
        import shutil

        if self.plan is not None and self.plan.owned_ec_cache:
            shutil.rmtree(self.plan.owned_ec_cache, ignore_errors=True)

    def _teardown(self) -> None:
        """Stop every process this run started, whatever state it is in."""
        import contextlib

        from vime.runtime.process import sweep_run_processes

        _TEARING_DOWN.set()  # from now on a Ctrl-C hurries the clean-up instead of cutting it short
        try:
            for step in (self._stop_rollout_workers, self._kill_unlaunched_worker,
                         lambda: self.engine_manager and self.engine_manager.stop(),
                         *(model.stop for model in self.frozen_models),
                         lambda: self.router and self.router.stop(),
                         lambda: self.controller and __import__("ray").get(self.controller.shutdown.remote(),
                                                                           timeout=30),
                         self._remove_encoder_cache):
                if _HURRIED.is_set():
                    break
                with contextlib.suppress(Exception):
                    step()
        except _StopNow:
            self.log.say("interrupted again: stopping every process of the run at once")
        _HURRIED.set()  # from here on a Ctrl-C is only noted: nothing may cut the rest short
        if self.ray_started:
            import ray

            # Always, and before the sweep: a driver still connected when its raylet is killed is ended by
            # Ray itself (exit status 1), before it could say what it stopped.
            with contextlib.suppress(Exception):
                ray.shutdown()
        # Whatever the orderly steps left (or skipped), by the run token: vLLM's EngineCore and Worker too.
        self.leftover = sweep_run_processes(self.token, exclude_pids=[os.getpid()])
        if self.leftover:
            self.log.say("these processes of the run could not be stopped: " + "; ".join(self.leftover))
        if self.guard is not None:
            with contextlib.suppress(Exception):  # the record stays: the next start on this queue sweeps it
                self.guard.close(everything_stopped=not self.leftover)
        self.log.close()
        _TEARING_DOWN.clear()
        _HURRIED.clear()


_INTERRUPTED = threading.Event()
_TEARING_DOWN = threading.Event()
_HURRIED = threading.Event()


class _StopNow(BaseException):
    """A Ctrl-C during the teardown: skip the orderly steps left and sweep the run's processes at once."""


def _on_sigterm(signum, frame):
    # Raised here, and remembered: a KeyboardInterrupt raised while the interpreter runs a
    # finalizer (a Ray ObjectRef's __del__, say) is swallowed by Python ("Exception ignored"),
    # so the training loop also checks the flag and stops at its next iteration. During the
    # teardown a KeyboardInterrupt would skip the rest of the clean-up, the final sweep included (the
    # engines' EngineCore/Worker processes would outlive the run): the first Ctrl-C there skips to
    # the sweep instead (_StopNow), later ones are only noted.
    _INTERRUPTED.set()
    if not _TEARING_DOWN.is_set():
        raise KeyboardInterrupt
    if not _HURRIED.is_set():
        _HURRIED.set()
        raise _StopNow


def _raise_if_interrupted() -> None:
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_train_args(argv)
    except ConfigError as error:
        print(f"vime train: error: {error}", file=sys.stderr)
        return 2
    _INTERRUPTED.clear()
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)  # Ctrl-C: the same orderly stop, whatever an import installed
    run = TrainingRun(settings)
    try:
        return run.run()
    except KeyboardInterrupt:
        # Said only after the teardown's sweep found no process of the run alive (sweep_run_processes).
        stopped = ("every process started by this run was stopped" if not getattr(run, "leftover", None)
                   else f"{len(run.leftover)} process(es) of this run could not be stopped: {'; '.join(run.leftover)}")
        print(f"vime train: interrupted; {stopped}", file=sys.stderr)
        return 130
    except Exception as error:
        original = _unwrap(error)
        if isinstance(original, _user_errors()):
            print(f"vime train: error: {original}", file=sys.stderr)
            return 1
        if getattr(original, "actor_init_failed", False):  # Ray keeps only the text of such a cause
            print(f"vime train: error: a worker failed to start: {str(original).strip().splitlines()[-1]}",
                  file=sys.stderr)
            return 1
        raise
