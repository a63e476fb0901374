"""The processes of one `vime train` run, which its driver (vime/train.py) owns as one :class:`RunProcesses`.

At the start: the guard against dead runs' leftovers (the reaper, vime/runtime/reaper.py), Ray, the
controller, the trainer's ranks, the model serving (routers, engines: workers/serving.py) and the first
rollout worker's actor. At the end, whatever state the run is in: each group stopped in reverse start
order, then Ray, then a sweep by the run token of whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

from vime.data.source import DataKeys
from vime.recovery.volume_failure import forget_volume_restarts
from vime.runtime import interrupts

if TYPE_CHECKING:
    from vime.config import TrainSettings
    from vime.metrics import MetricsLog

TEARDOWN_SLOW_S = 5.0  # a step of the teardown slower than this is said in the progress output


class RunProcesses:
    """Starts and stops the processes of one run, and holds their handles for the driver: ``controller``
    (the queue's Ray actor), ``trainer`` (workers/trainer_group.py), ``serving`` (workers/serving.py),
    ``rollout`` (workers/rollout_group.py) and ``run_guard`` (vime/runtime/incarnations.py); each is None
    until started. The verbs, in the order the driver calls them: :meth:`guard`, :meth:`start`,
    :meth:`stop_rollout_workers` (the end of a run that went well) and :meth:`teardown` (always), after which
    ``leftover`` names the processes it could not stop.

    ``log`` is the driver's: its progress output and records, closed by the teardown before the sweep.
    ``ray_namespace``: where `vime engines` finds the run's registry (docs/elastic.md).
    ``storage_declaration``: straw's, checked against the mount by the pre-flight checks."""

    def __init__(
        self,
        settings: TrainSettings,
        *,
        token: str,
        run_dir: str,
        log: MetricsLog,
        ray_namespace: str,
        storage_declaration: dict | None,
    ):
        self.s = settings
        self.token, self.run_dir, self.log = token, run_dir, log
        self.ray_namespace, self.storage_declaration = ray_namespace, storage_declaration
        self.run_guard = None  # vime.runtime.incarnations.RunGuard: the reaper and the record
        self.ray_started = False
        self.controller = None  # the controller's Ray actor (vime.workers.controller.Controller)
        self.controller_incarnation = ""  # the one that first answered (a later one: a restart, StepRecords says)
        # vime.workers.trainer_group.TrainerGroup. A restart in place (workers/trainer_restart.py) replaces its
        # ranks, not the group: the weight synchronisation and this teardown keep calling the live ranks.
        self.trainer = None
        self.serving = None  # vime.workers.serving.ModelServing: routers, engines, frozen models
        self.rollout = None  # vime.workers.rollout_group.RolloutGroup: the rollout workers
        self.leftover: list[str] = []  # processes of the run the teardown could not stop

    def guard(self) -> None:
        """Before any process starts: stop what dead runs on this queue left behind, and start the reaper
        that stops this run's processes if the driver dies without its teardown (a SIGKILL, the OOM
        killer). See vime/runtime/reaper.py and vime/runtime/incarnations.py."""
        from vime.runtime.incarnations import RunGuard

        self.run_guard = RunGuard.start(
            self.token, data_dir=self.s.rollout_data_dir, run_dir=self.run_dir, say=self.log.say
        )

    @property
    def store_options(self):
        from vime.queue.rollout_queue import StoreOptions

        q = self.s.queue
        return StoreOptions(
            self.s.rollout_data_dir,
            q.rollout_queue_run_id,
            q.rollout_queue_segment_mib,
            q.rollout_queue_online_gc,
            q.rollout_storage_profile,
            self.storage_declaration,
        )

    def start(self, *, plan: Any, trained_model: str | None, prompt_rows: list[int] | None) -> None:
        """Ray, then the controller and the trainer, whose processes start (imports, the queue's recovery, the
        model's load: ~5 s) while the engines do; on GPUs the engines start first, alone: vLLM measures the
        device's free memory as it starts, which a trainer loading beside it would change. ``plan`` and
        ``trained_model``: what to serve (vime/preflight.py's launch plan of --vllm-config and its weight-synced
        model); ``prompt_rows``: the rows of --prompt-data the controller opens (--rollout-max-prompt-len)."""
        import ray

        self._start_ray()
        beside_the_engines = ray.cluster_resources().get("GPU", 0) == 0
        if beside_the_engines:
            self._start_controller_and_trainer(prompt_rows)
        from vime.workers.serving import ModelServing

        self.serving = ModelServing(
            self.s,
            plan=plan,
            trained_model=trained_model,
            run_dir=self.run_dir,
            run_token=self.token,
            say=self.log.say,
            record=self.log.write,
        )
        # The first rollout worker's process starts (imports, tokenizer, hooks) as soon as it knows the router,
        # while the engines and the trainer start; it opens its queue writer and generates only after recovery
        # (the driver starts the rollout workers).
        self.serving.start(
            registry_namespace=self.ray_namespace, on_router=self._prepare_rollout if beside_the_engines else None
        )
        if not beside_the_engines:
            self._start_controller_and_trainer(prompt_rows)
            self._prepare_rollout()
        ready = ray.get([self.controller.ready.remote(), self.trainer.leader.ready.remote()], timeout=600)
        self.controller_incarnation = ready[0]["incarnation"]
        self.log.say(
            f"controller ready: {ready[0]['accepted']} accepted group(s) in the queue, {ready[0]['consumed']} trained"
        )

    def _prepare_rollout(self) -> None:
        from vime.workers.rollout_group import RolloutGroup

        self.rollout = RolloutGroup(self._create_worker, self.controller, say=self.log.say, record=self.log.write)
        self.rollout.prepare()  # worker 0's actor: its process imports and loads while the rest starts

    def _start_controller_and_trainer(self, prompt_rows: list[int] | None) -> None:
        """Create the controller and the trainer's ranks; their readiness is waited for by the caller (several
        trainer ranks form their process group here, which waits for each rank's start)."""
        import ray

        from vime.workers.cluster import trainer_cpus, trainer_gpus_per_rank
        from vime.workers.controller import Controller, ControllerSpec
        from vime.workers.trainer_group import TrainerGroup
        from vime.workers.trainer_worker import TrainerWorkerSpec

        s = self.s
        self.log.say(
            f"opening the {s.queue.rollout_data_transport} queue"
            + (f" in {s.rollout_data_dir}" if s.queue.rollout_data_transport == "straw" else "")
        )
        controller_spec = ControllerSpec(
            transport=s.queue.rollout_data_transport,
            store=self.store_options,
            lease_seconds=s.queue.rollout_queue_lease_seconds,
            prompt_data=s.data.prompt_data,
            keys=DataKeys(s.data.input_key, s.data.label_key, s.data.metadata_key),
            seed=s.rollout.rollout_seed if s.rollout.rollout_seed is not None else s.run.seed,
            shuffle=s.data.rollout_shuffle,
            num_epoch=s.data.num_epoch,
            groups_per_rollout=s.rollout.rollout_batch_size,
            max_staleness=s.max_staleness,
            data_source_path=s.data.data_source_path,
            args=s.args,
            prompt_rows=prompt_rows,
            refill_multiple=s.rollout.over_sampling_batch_size,
            restart_on_volume_failure=True,
        )
        # The controller is restartable: a new incarnation recovers the queue from its journal (every
        # lease of the old one fenced) and calls in flight are retried against it; it also ends itself after a
        # write of the queue its volume failed (recovery/volume_failure.py). It runs on the driver's node
        # where it can: it holds the queue's lock through its node's mount of --rollout-data-dir, and on a
        # JuiceFS volume a lock taken through the client of a lost node stays held by the dead client's session,
        # so a restarted controller could not take it (docs/juicefs.md). Soft: a restart can go elsewhere.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_driver_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        if s.queue.rollout_data_transport == "straw":
            # A new run: the restarts an earlier run's controllers counted on this queue are not this run's.
            with contextlib.suppress(OSError):  # (a volume failing now: the controller waits for it)
                forget_volume_restarts(self.store_options.data_dir)
        self.controller = (
            ray.remote(num_cpus=0, max_restarts=10, max_task_retries=-1, name=Controller.ACTOR_NAME)(Controller)
            .options(scheduling_strategy=on_driver_node)
            .remote(controller_spec)
        )
        threads, affinity = trainer_cpus(s.cluster, s.train)
        trainer_spec = TrainerWorkerSpec.from_settings(
            s,
            transport=s.queue.rollout_data_transport,
            store=self.store_options,
            threads=threads,
            cpu_affinity=affinity,
        )
        ranks = s.cluster.num_trainers
        self.log.say(
            f"starting the trainer ({s.train.train_backend} backend, "
            + (f"{ranks} ranks, " if ranks > 1 else "")
            + f"{threads} thread(s)"
            + (" each)" if ranks > 1 else ")")
        )
        self.trainer = TrainerGroup.start(
            trainer_spec, ranks, gpus_per_rank=trainer_gpus_per_rank(s.cluster), timeout=600
        )

    def _start_ray(self) -> None:
        from vime.workers.cluster import start_ray

        gcs_address = start_ray(
            self.s.cluster,
            token=self.token,
            namespace=self.ray_namespace,
            debug_logs=self.s.run.log_level == "debug",
            say=self.log.say,
        )
        self.ray_started = True
        # `vime engines --run RUN_DIR` attaches to this Ray cluster and namespace (docs/elastic.md).
        self._update_run_json(ray_address=gcs_address, ray_namespace=self.ray_namespace)

    def _update_run_json(self, **fields) -> None:
        path = os.path.join(self.run_dir, "run.json")
        with open(path) as f:
            info = json.load(f)
        info.update(fields)
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)

    def _create_worker(self, index: int, node_id: str | None = None):
        """Rollout worker ``index``'s actor (anywhere, or on ``node_id``), its queue not opened yet."""
        from vime.workers.rollout_worker import RolloutWorkerSpec, create_rollout_actor

        spec = RolloutWorkerSpec.from_settings(
            self.s, index=index, router_url=self.serving.router_url, store=self.store_options
        )
        return create_rollout_actor(spec, self.controller, node_id)

    def stop_rollout_workers(self) -> None:
        if self.rollout is None or not self.rollout.actors:
            return
        self.serving.end()  # the run is ending: an engine lost now is not restarted
        self.rollout.stop(self.serving.abort_requests, wait_seconds=self.s.rollout.rollout_request_timeout + 60)

    def teardown(self) -> None:
        """Stop every process this run started, whatever state it is in: each group in reverse start order,
        then Ray, then a sweep by the run token of whatever is left (vLLM's EngineCore and Worker too)."""
        from vime.runtime.process import sweep_run_processes

        with interrupts.teardown():  # from now on a Ctrl-C hurries the clean-up instead of cutting it short
            try:
                self._stop_in_order()
            except interrupts.StopNow:
                self.log.say("interrupted again: stopping every process of the run at once")
            interrupts.hurry()  # from here on a Ctrl-C is only noted: nothing may cut the rest short
            self.log.close()  # before the sweep, which would kill wandb's service (it carries the token) unflushed
            if self.ray_started:
                import ray

                # Always, and before the sweep: a driver still connected when its raylet is killed is ended
                # by Ray itself (exit status 1), before it could say what it stopped.
                with contextlib.suppress(Exception):
                    ray.shutdown()
            self.leftover = sweep_run_processes(self.token, exclude_pids=[os.getpid()])
            if self.leftover:
                self.log.say("these processes of the run could not be stopped: " + "; ".join(self.leftover))
            if self.run_guard is not None:
                with contextlib.suppress(Exception):  # the record stays: the next start on this queue sweeps it
                    self.run_guard.close(everything_stopped=not self.leftover)

    def _stop_controller(self) -> None:
        if self.controller is not None:
            import ray

            ray.get(self.controller.shutdown.remote(), timeout=30)

    def _stop_in_order(self) -> None:
        """The orderly steps of the teardown; a Ctrl-C meanwhile skips the rest (StopNow)."""
        steps = [
            ("the rollout workers", self.stop_rollout_workers),
            ("an unlaunched rollout worker", lambda: self.rollout and self.rollout.kill_unlaunched()),
            ("the trainer", lambda: self.trainer and self.trainer.shutdown()),
            *(self.serving.stop_steps() if self.serving else ()),
            ("the controller", self._stop_controller),
        ]
        for what, step in steps:
            if interrupts.hurried():
                return
            started = time.monotonic()
            with contextlib.suppress(Exception):
                step()
            if time.monotonic() - started > TEARDOWN_SLOW_S:  # said, so that a slow stop can be told apart
                self.log.say(f"stopping {what} took {time.monotonic() - started:.0f}s")
