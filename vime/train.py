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

The run's processes are started, held and stopped by the :class:`RunProcesses` the driver owns
(workers/run_processes.py): the driver reaches the controller, the trainer, the model serving and the
rollout workers through it. Each step's record is workers/step_records.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

from vime import preflight
from vime.config import ConfigError, TrainSettings, parse_train_args
from vime.errors import UserError
from vime.metrics import MetricsLog, plot_rewards
from vime.recovery import checkpoint as ckpt, faults
from vime.recovery.disk_full import RunVolumes, resume_hint
from vime.recovery.disk_space import FreeSpaceWatch
from vime.recovery.lineage import Lineage, resumed
from vime.recovery.retention import apply_retention
from vime.rollout.evaluate import HeldOutEvaluation
from vime.runtime import interrupts
from vime.tracking import RunTracker
from vime.weights.policy import flush_for_sync
from vime.workers.failure_reasons import died_for_good
from vime.workers.run_processes import RunProcesses
from vime.workers.step_records import StepRecords

POLL_SECONDS = 0.05
# How long one call waits in the controller for a step's groups (Controller.take_groups_or_wait): between two
# calls the driver looks at its engines, nodes and rollout workers, so this bounds how late it sees them.
GROUPS_WAIT_SECONDS = 0.5


class RunError(UserError, RuntimeError):
    """A failure the user can act on; printed as one line (plus any log tail it carries)."""


def _unwrap(error: BaseException) -> BaseException:
    """Ray wraps an actor's exception; report the original."""
    cause = getattr(error, "cause", None)
    return _unwrap(cause) if isinstance(cause, BaseException) and cause is not error else error


class TrainingRun:
    """One `vime train` run: pre-flight, start, the loop, teardown. Its processes are ``self.processes``."""

    def __init__(self, settings: TrainSettings, *, storage_declaration: dict | None = None):
        self.s = settings
        self.token = uuid.uuid4().hex
        self.run_dir = settings.run.run_dir
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self.log = MetricsLog(self.run_dir)
        self.processes = RunProcesses(
            settings,
            token=self.token,
            run_dir=self.run_dir,
            log=self.log,
            ray_namespace=f"vime-{self.token[:12]}",  # `vime engines` finds the run's registry there
            storage_declaration=storage_declaration,  # straw's, checked against the mount (preflight)
        )
        self.weight_sync = None  # vime.workers.engines.WeightSync, built at the first publication
        self.colocation = None  # vime.workers.colocation.ColocatedMemory with --colocate's offload
        self.engine_errors_seen = 0  # the rollout workers' engine_errors at the last step
        self.requests_seen = 0  # and their generate_requests
        self.publications_seen = 0  # and their queue publications
        self.last_saved_step: int | None = None
        self.volumes = RunVolumes.from_settings(settings)  # each said by its flag when it fills
        self.version = 0  # the weight version every engine serves
        self.weights_held = False  # the trainer holds steps not published yet (--update-weights-interval)
        self.cursor = 0  # accepted groups handed to the trainer so far
        self.step_cursors: list[int] = []  # the cursor after each step of this lineage
        self.skipped: list[int] = []  # positions passed over as too stale (prompts regenerated)
        self.lineage = Lineage()  # restores in place: which versions are lost (recovery/lineage.py)
        self.step = 0  # steps trained in the surviving lineage
        self.restarter = None  # vime.workers.trainer_restart.TrainerRestarter

    # ================================================================== entry
    def run(self) -> int:
        if self.s.debug.load_debug_rollout_data:  # debug replay: recorded batches, no engines (vime/replay.py)
            from vime.replay import replay

            return replay(self.s, self.log)
        try:
            self.processes.guard()
            inputs = self._check_inputs()
            self.processes.start(plan=inputs.plan, trained_model=inputs.trained_model, prompt_rows=inputs.prompt_rows)
            start_step, version = self._restore()
            self._reap_dead_producers()
            self.before = (
                {}
                if self.s.eval.skip_eval_before_train
                else self._evaluate(version, step=start_step, label="before training")
            )
            self._start_rollout_workers()
            with self.volumes.queue.stop_when_full("a call on the queue's coordinator"):  # straw's journal
                if self.s.debug.debug_rollout_only:  # generate and store, train nothing (vime/rollout_only.py)
                    from vime.rollout_only import rollout_only

                    return rollout_only(self, start_step, version)
                version = self._train(start_step, version)
            self._finish(version)
            return 0
        finally:
            self.processes.teardown()

    # ================================================================== set-up
    def _check_inputs(self) -> preflight.Inputs:
        """Everything that can be checked before a process starts (vime/preflight.py); returns what it loaded
        (the launch plan and the prompt rows are for :meth:`RunProcesses.start`)."""
        inputs = preflight.check_inputs(self.s, self.log.say)
        self.evaluation = HeldOutEvaluation(self.s, inputs.eval_sets, inputs.tokenizer, inputs.reward, self.log)
        self.resume = inputs.resume  # (folder, CheckpointState) or None
        resumed_from = self.resume[1].step if self.resume else None  # wandb, TensorBoard: vime/tracking.py
        self.log.attach(RunTracker.start(self.s, run_token=self.token, resumed_from=resumed_from, say=self.log.say))
        if inputs.prompt_rows is not None:  # --rollout-max-prompt-len: what it left out (also said at start-up)
            self.log.write(
                {
                    "kind": "data",
                    "prompts": inputs.prompts_total,
                    "prompts_kept": len(inputs.prompt_rows),
                    "prompts_too_long": inputs.prompts_total - len(inputs.prompt_rows),
                    "rollout_max_prompt_len": self.s.rollout.rollout_max_prompt_len,
                }
            )
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"run_token": self.token, "argv": sys.argv, "pid": os.getpid()}, f)
        return inputs

    def _poll_engines(self) -> None:
        """Membership changes (health, restarts, `vime engines`, nodes that join or leave, a dead router:
        workers/serving.py); a new node's rollout worker starts once its first engine serves the current
        weights."""
        from vime.workers.engine_members import EnginesLost

        serving, rollout = self.processes.serving, self.processes.rollout
        if serving is None:
            return
        try:
            events = serving.poll(self.version)
        except EnginesLost as error:
            raise RunError(str(error)) from None
        for event in events:
            if event.kind == "ready" and rollout is not None and rollout.actors:
                index = rollout.add_on_node(event.node_id)
                if index is not None:
                    self.log.say(f"rollout worker {index} generating on node {event.node_id[:12]}")

    def _engine_health(self) -> dict[str, Any]:
        """For the step's record and progress line: engines serving, the engine faults since the last step
        (quarantines, restarts, drops), the generate requests sent meanwhile and those that engines failed (each
        sent its group back to the queue; no attempt of the prompt was spent), and the queue publications the
        accepted groups took."""
        import ray

        health = self.processes.serving.health() if self.processes.serving is not None else {}
        try:
            stats = self.processes.rollout.stats(timeout=10)
        except (ray.exceptions.RayError, TimeoutError):  # a dead worker: _check_workers deals with it
            return health
        errors = sum(s.engine_errors for s in stats)
        health["rollout_engine_errors"] = max(0, errors - self.engine_errors_seen)  # a new worker counts from 0
        if health["rollout_engine_errors"] > 0:
            health["rollout_last_engine_error"] = next((s.last_engine_error for s in stats if s.last_engine_error), "")
        self.engine_errors_seen = errors
        requests = sum(s.generate_requests for s in stats)
        health["rollout_generate_requests"] = max(0, requests - self.requests_seen)
        self.requests_seen = requests
        publications = sum(s.queue_publications for s in stats)
        health["rollout_queue_publications"] = max(0, publications - self.publications_seen)
        self.publications_seen = publications
        return health

    def _restore(self) -> tuple[int, int]:
        """(first rollout id, weight version) — from the checkpoint when resuming."""
        import ray

        if self.resume is None:
            if self._actor_starts_from_ref_load():
                # The engines loaded --hf-checkpoint; the trainer holds --ref-load's weights (the seeds: the actor
                # starts from --ref-load when --load holds no checkpoint). Version 0 must be what the trainer
                # holds before anything is generated with it, as the reference syncs its engines at start.
                self.log.say("the actor starts from --ref-load: publishing its weights to the engines as version 0")
                self._publish(0, sync_number=1)
            return 0, 0
        folder, state = self.resume
        self.log.say(
            f"resuming from {folder}: step {state.step}, weight version {state.weight_version}, "
            f"{state.consumer_cursor} group(s) trained"
        )
        if not ray.get(self.processes.controller.history_available.remote(state.consumer_cursor)):
            raise RunError(
                f"the accepted groups after step {state.step} were reclaimed by "
                "--rollout-queue-online-gc; only the latest checkpoint can be resumed "
                f"(see {ckpt.LATEST} in {self.s.checkpoint.load})"
            )
        if self.s.checkpoint.no_load_optim:
            self.log.say("--no-load-optim: the trainer loads the checkpoint's weights; its optimizer starts afresh")
        self.processes.trainer.load_checkpoint(folder, optimizer=not self.s.checkpoint.no_load_optim)
        # The checkpoint's cursor is authoritative: the queue's committed cursor may lag behind it
        # (a crash between the two writes) and may be ahead of it (resuming an older --ckpt-step).
        self.cursor, self.step_cursors = state.consumer_cursor, list(state.step_cursors)
        self.skipped = list(state.skipped)
        version = self._resumed_version(state)
        self._publish(version, sync_number=1)
        return state.step, version

    def _actor_starts_from_ref_load(self) -> bool:
        """Whether a fresh run's actor holds other weights than the engines' --hf-checkpoint: --ref-load given
        (a Megatron checkpoint, or its conversion for the torch trainer, or another HF folder)."""
        ref_load = self.s.algorithm.ref_load
        if ref_load is None or "://" in ref_load:
            return False
        return os.path.realpath(ref_load) != os.path.realpath(self.s.train.hf_checkpoint)

    def _resumed_version(self, state) -> int:
        """The version to publish the checkpoint's weights under (sets the lineage): versions the run before
        gave out after its checkpoint are never given out again, so that a number names one set of weights
        in staleness, metrics and `vime queue inspect` (recovery/lineage.py)."""
        import ray

        from vime.weights.disk import published_versions

        newest = max(
            ray.get(self.processes.controller.newest_token_version.remote(state.consumer_cursor)),
            *published_versions(self.s.weight_dir),
            *(r.version for r in state.lineage.restores),
            state.weight_version,
        )
        self.lineage, version = resumed(
            state.lineage, step=state.step, restored_version=state.weight_version, newest_given_out=newest
        )
        if version != state.weight_version:
            self.log.say(
                f"the run before gave out weight versions {state.weight_version + 1}-{newest} after this "
                f"checkpoint; those weights are lost (groups with their tokens run their prompts again), and "
                f"the checkpoint's weights are published as version {version}"
            )
        return version

    def _reap_dead_producers(self) -> None:
        """Publications left unaccepted by producers of an earlier (dead) incarnation."""
        import ray

        report = ray.get(self.processes.controller.reap_writers.remote([]))
        if report.get("publications_released"):
            self.log.say(
                f"released {report['publications_released']} orphaned publication(s) of "
                f"{report['writers_retired']} dead producer(s)"
            )

    # ================================================================== rollout and training
    def _start_rollout_workers(self) -> None:
        self.processes.rollout.start()
        self.log.say(f"{len(self.processes.rollout.actors)} rollout worker(s) generating")

    def _check_workers(self) -> None:
        """Dead rollout workers are replaced, those of a node that left are dropped
        (workers/rollout_group.py); past its budget the run stops."""
        from vime.workers.rollout_group import RolloutWorkersLost

        try:
            self.processes.rollout.poll()
        except RolloutWorkersLost as error:
            raise RunError(str(error)) from None

    @property
    def trained(self) -> int:
        """Accepted groups trained in this lineage (the cursor minus those skipped as stale)."""
        return 0 if self.s.debug.debug_rollout_only else self.cursor - len(self.skipped)

    def consume(self, taken) -> None:
        """Move this lineage's cursor past a step's batch (trained, or with --debug-rollout-only stored)."""
        self.cursor = taken.next_cursor
        self.skipped.extend(taken.skipped)
        self.step_cursors.append(self.cursor)

    def wait_for_groups(self, count: int, step: int):
        import ray

        last_accepted, last_progress = None, time.monotonic()
        while True:
            interrupts.raise_if_interrupted()
            self._poll_engines()  # engine membership and health (docs/elastic.md); never blocks long
            if faults.held("driver.before_step", step):  # a test keeps the run open until its event happened
                self._check_workers()
                last_progress = time.monotonic()
                time.sleep(POLL_SECONDS)
                continue
            # The controller holds the call until the step's groups are there, or GROUPS_WAIT_SECONDS: the loop
            # polls the engines and the workers at least that often meanwhile.
            taken = ray.get(
                self.processes.controller.take_groups_or_wait.remote(
                    self.cursor,
                    count,
                    self.version,
                    self.trained,
                    lineage=self.lineage,
                    wait_seconds=GROUPS_WAIT_SECONDS,
                )
            )
            if taken.groups:
                return taken
            self._check_workers()
            stats = ray.get(self.processes.controller.stats.remote())
            if stats.end_of_data:
                # The prompts are exhausted: the last step trains whatever was accepted.
                taken = ray.get(
                    self.processes.controller.take_groups.remote(
                        self.cursor, count, self.version, self.trained, allow_partial=True, lineage=self.lineage
                    )
                )
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
                details = self.processes.rollout.stats()[0] if self.processes.rollout.actors else None
                engines = self.processes.serving.describe_engines()
                raise RunError(
                    f"no group was accepted for {time.monotonic() - last_progress:.0f}s "
                    f"(queue: {stats}); rollout worker: {details}; engines: {engines or 'none'}; "
                    f"engine logs are in {os.path.join(self.run_dir, 'logs')}. A run waits 2 x "
                    "--rollout-request-timeout + 60 s for an accepted group; raise --rollout-request-timeout where "
                    "one legitimately takes longer"
                )
            time.sleep(POLL_SECONDS)

    def _publish(self, version: int, *, sync_number: int) -> dict[str, float]:
        """Publish ``version`` and load it into every engine; returns the step record's sync metrics:
        ``weight_sync_seconds`` (all of it), ``weight_sync_publish_s`` (the trainer writing the
        version) and ``weight_sync_pause_s`` (the longest time an engine generated nothing). With
        --debug-train-only there is no engine: the version moves on and nothing is written."""
        started = time.monotonic()
        report = {} if self.s.debug.debug_train_only else self._sync_engines(version, sync_number)
        self.version, self.weights_held = version, False
        self._sync_controller()
        return {
            "weight_sync_seconds": time.monotonic() - started,
            "weight_sync_publish_s": float(report.get("weight_publish_seconds", 0.0)),
            "weight_sync_pause_s": float(report.get("weight_pause_seconds", 0.0)),
        }

    def _sync_engines(self, version: int, sync_number: int) -> dict[str, Any]:
        """The trainer publishes ``version`` and every engine loads it (vime.workers.engines.WeightSync;
        docs/weights.md); returns the synchronisation's report, also written as a ``weight_sync`` record."""
        serving = self.processes.serving
        if self.weight_sync is None:
            from vime.workers.engines import WeightSync

            # The trainer group stays the same object across restarts in place: the sync keeps calling its ranks.
            self.weight_sync = WeightSync(self.processes.trainer, serving.engines, self.s.weights)
        flush = flush_for_sync(sync_number, self.s.weights.flush_cache_interval)
        with (
            serving.engine_manager.updating() if serving.engine_manager else contextlib.nullcontext(),
            self.volumes.weights.stop_when_full(f"the publication of weight version {version}"),
        ):
            report = self.weight_sync.sync(version, flush=flush)
        self.log.write({"kind": "weight_sync", "step": self.step + 1, **report})  # the step being trained
        return report

    def _train(self, start_step: int, version: int) -> int:
        from vime.workers.trainer_group import TrainerDied
        from vime.workers.trainer_restart import TrainerStepFailed

        assert version == self.version  # what every engine serves; _publish keeps it from now on
        s = self.s
        batch = s.rollout.rollout_batch_size
        sync_number = 1 if self.resume else 0  # the restore already published once
        steps = StepRecords(  # the throughput window begins here
            self.processes.controller, incarnation=self.processes.controller_incarnation, say=self.log.say
        )
        self.log.say(
            f"training: {s.train.num_rollout - start_step} rollout(s) of {batch} group(s) x "
            f"{s.rollout.n_samples_per_prompt} sample(s)"
        )
        from vime.workers.colocation import ColocatedMemory

        colocation = self.colocation = ColocatedMemory.for_run(
            s, self.processes.serving, self.processes.trainer, say=self.log.say
        )
        colocation.after_weight_update()  # the engines serve the first version: the trainer makes room
        self.restarter = self._trainer_restarter()
        disk = FreeSpaceWatch.from_settings(s, say=self.log.say)  # free space and --min-free-disk-gb
        rollout_id = self.step = start_step
        last_taken = time.monotonic()  # what a rollout took: the time between two batches taken
        while rollout_id < s.train.num_rollout:
            interrupts.raise_if_interrupted()
            try:
                taken = self.wait_for_groups(batch, rollout_id + 1)
            except StopIteration:
                self.log.say(f"--num-epoch {s.data.num_epoch} exhausted the prompts after {rollout_id} rollout(s)")
                break
            rollout_time, last_taken = time.monotonic() - last_taken, time.monotonic()
            try:
                metrics = self._train_step(
                    rollout_id, taken, colocation, sync_number=sync_number + 1, rollout_time=rollout_time
                )
            except (TrainerDied, TrainerStepFailed) as error:  # restored in place, or the run stops
                rollout_id = self._restart_trainer(error, rollout_id + 1, colocation)
                sync_number = 1  # the restore published once, flushing
                continue
            if not self.weights_held:
                sync_number += 1
            rollout_id = step = self.step = rollout_id + 1
            version = self.version
            record = {
                **steps.record(step, version, metrics, regenerated=len(taken.skipped)),
                **self._engine_health(),
                **disk.sample(),
            }
            self.log.write(record)
            self.log.progress(record, s.train.num_rollout)
            if s.eval.eval_interval and step % s.eval.eval_interval == 0 and step < s.train.num_rollout:
                self._evaluate(version, step=step, label=f"step {step}")
        if self.weights_held:  # the prompts ran out between publications: the final weights reach the engines
            self._publish(self.version + 1, sync_number=sync_number + 1)
        return self.version

    def _train_step(
        self, rollout_id: int, taken, colocation, *, sync_number: int, rollout_time: float = 0.0
    ) -> dict[str, Any]:
        """Train on ``taken``, publish the new weights, checkpoint or commit: the trainer's part of a step
        (what a trainer restored in place redoes). Returns the step's metrics; ``rollout_time``: the seconds
        since the previous step's batch was taken (what --custom-rollout-log-function-path is told)."""
        import ray

        from vime.workers.trainer_restart import TrainerStepFailed

        s, step = self.s, rollout_id + 1
        colocation.before_training()
        try:
            metrics = self.processes.trainer.train_rollout(
                rollout_id, taken.groups, self.version, self.lineage, rollout_time=rollout_time
            )
        except ray.exceptions.RayTaskError as error:
            if isinstance(_unwrap(error), UserError):
                raise  # the user's to fix: it would fail again after a restart
            raise TrainerStepFailed(f"{type(_unwrap(error)).__name__}: {_unwrap(error)}") from error
        if s.debug.save_debug_rollout_data:  # debug replay: archive the batch just trained (vime/replay.py)
            from vime.replay import save_trained_batch

            with self.volumes.debug_archive.stop_when_full(f"the debug archive of rollout {rollout_id}"):
                save_trained_batch(self, rollout_id, taken.groups, self.version, metrics)
        self.consume(taken)
        if self._publishes_after(step):
            metrics.update(self._publish(self.version + 1, sync_number=sync_number))
        else:
            metrics.update(self._hold_weights())
        colocation.after_weight_update()
        if s.checkpoint.save and s.checkpoint.save_interval and step % s.checkpoint.save_interval == 0:
            self._save(step, self.version)
        elif not s.checkpoint.save:
            self._commit(step)
        return metrics

    def _publishes_after(self, step: int) -> bool:
        """Whether ``step``'s weights are published (--update-weights-interval): every N-th step, and always a
        step that saves a checkpoint (a checkpoint's weights are a published version, which a resume gives out
        again under its number: recovery/lineage.py), runs an evaluation (it measures what the engines serve) or
        is the last."""
        s = self.s
        interval = s.weights.update_weights_interval
        saves = bool(s.checkpoint.save and s.checkpoint.save_interval and step % s.checkpoint.save_interval == 0)
        evaluates = bool(s.eval.eval_interval and step % s.eval.eval_interval == 0)
        return interval == 1 or step % interval == 0 or saves or evaluates or step >= s.train.num_rollout

    def _hold_weights(self) -> dict[str, float]:
        """A step between publications: the engines keep serving ``self.version`` while the trainer holds newer
        weights; admission still moves on with the groups trained."""
        self.weights_held = True
        self._sync_controller()
        return {"weight_sync_seconds": 0.0, "weight_sync_publish_s": 0.0, "weight_sync_pause_s": 0.0}

    def _sync_controller(self) -> None:
        """The controller's view of the run: the version every engine serves, the cursor, the groups trained."""
        import ray

        ray.get(self.processes.controller.sync.remote(self.version, self.cursor, self.trained, self.lineage))

    def _commit(self, step: int) -> None:
        """Mark the groups trained by ``step`` in the queue (the consumer cursor), durably."""
        import ray

        with self.volumes.queue.stop_when_full(f"the queue's commit of step {step}"):
            ray.get(self.processes.controller.commit.remote(step, self.cursor, self.step_cursors, self.skipped))

    def _trainer_restarter(self):
        from vime.workers.trainer_restart import TrainerRestarter

        return TrainerRestarter(
            self.processes.trainer,
            budget=self.s.checkpoint.trainer_restart_budget,
            save_dir=self.s.checkpoint.save,
            resumed=self.resume,
            resumed_optimizer=not self.s.checkpoint.no_load_optim,
        )

    def _restart_trainer(self, error: Exception, step: int, colocation) -> int:
        """The trainer died during ``step`` (or failed inside it, not by the user's fault): restore it in place
        from the lineage's latest checkpoint while generation goes on (workers/trainer_restart.py), or stop the
        run when --trainer-restart-budget is spent. Returns the rollout id to go on from."""
        restored = self.restarter.recover(
            error,
            step,
            saved_step=self.last_saved_step,
            serve=lambda restored: self._serve_restored(restored, colocation),
            log=self.log,
        )
        self.step = restored.step
        return restored.step

    def _serve_restored(self, restored, colocation) -> int:
        """Rewind to what the restored trainer holds and publish it to the engines; returns its new version."""
        import ray

        from vime.weights.disk import published_versions

        if not ray.get(self.processes.controller.history_available.remote(restored.consumer_cursor)):
            raise RunError(
                f"the trainer cannot be restored to step {restored.step}: the accepted groups after it "
                "were reclaimed by --rollout-queue-online-gc"
            ) from None
        # Back to the restored step's cursor: the groups accepted after it are trained again (those that carry
        # tokens of lost versions are not: their prompts run again, recovery/lineage.py).
        self.cursor, self.step_cursors, self.skipped = (
            restored.consumer_cursor,
            restored.step_cursors,
            restored.skipped,
        )
        # Versions only ever increase: one the dead trainer wrote but no engine loaded is lost too, and so is
        # one an earlier attempt of this restore gave out.
        version = 1 + max(
            [self.version, *published_versions(self.s.weight_dir), *(r.version for r in self.lineage.restores)]
        )
        self.lineage = self.lineage.restored(
            step=restored.step, restored_version=restored.weight_version, new_version=version
        )
        if self.weight_sync is not None:
            self.weight_sync.trainer_restarted()
        self._publish(version, sync_number=1)  # flushes: requests in flight run on weights that are lost
        colocation.after_weight_update()
        return version

    # ================================================================== evaluation and the end
    def _evaluate(self, version: int, *, step: int, label: str) -> dict[str, float]:
        """Held-out reward of every --eval-prompt-data set (vime.rollout.evaluate.HeldOutEvaluation)."""
        return self.evaluation.run(self.processes.serving.router_url, version=version, step=step, label=label)

    def _save(self, step: int, version: int) -> None:
        state = ckpt.CheckpointState(
            schema=1,
            step=step,
            weight_version=version,
            consumer_cursor=self.cursor,
            run_options=preflight.run_options(self.s),
            step_cursors=list(self.step_cursors),
            skipped=list(self.skipped),
            lineage=self.lineage,
        )
        with self.volumes.checkpoint.stop_when_full(f"the checkpoint write of step {step}"):
            folder = ckpt.save_checkpoint(self.s.checkpoint.save, state, self.processes.trainer.save_checkpoint)
        self._commit(step)
        self.last_saved_step = step
        self.log.say(f"saved {folder}")
        # the commit just made: the queue's committed cursor is the driver's
        apply_retention(self.s.checkpoint, committed_cursor=self.cursor, say=self.log.say)

    def _finish(self, version: int) -> None:
        s = self.s
        self.processes.stop_rollout_workers()
        after = self._evaluate(version, step=self.step, label="after training")
        for name, before in self.before.items():
            self.log.say(f"held-out reward on {name!r}: {before:.3f} -> {after[name]:.3f}")
        if s.checkpoint.save and self.last_saved_step != self.step:
            self._save(self.step, version)  # a restore in place publishes a version that is no step
        if s.checkpoint.save_hf:
            path = os.path.join(self.run_dir, "hf_final")
            self.processes.trainer.save_hf(path)
            self.log.say(f"final model: {path}")
        png = plot_rewards(self.log.path, os.path.join(self.run_dir, "reward_curve.png"))
        self.log.say(f"metrics: {self.log.path}; reward curve: {png}")
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump({"weight_version": version, "eval_before": self.before, "eval_after": after}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_train_args(argv)
    except ConfigError as error:
        print(f"vime train: error: {error}", file=sys.stderr)
        return 2
    try:
        preflight.check_written_directories(settings)  # before the run creates its directories
        storage_declaration = preflight.storage_declaration(settings)  # a JuiceFS mount, read and checked
    except UserError as error:
        print(f"vime train: error: {error}", file=sys.stderr)
        return 1
    interrupts.install()  # Ctrl-C and SIGTERM: the same orderly stop, whatever an import installed
    run = TrainingRun(settings, storage_declaration=storage_declaration)
    try:
        with interrupts.Redelivery():
            return run.run()
    except KeyboardInterrupt:
        # Said only after the teardown's sweep found no process of the run alive (sweep_run_processes).
        stopped = (
            "every process started by this run was stopped"
            if not run.processes.leftover
            else f"{len(run.processes.leftover)} process(es) of this run could not be stopped: "
            f"{'; '.join(run.processes.leftover)}"
        )
        print(f"vime train: interrupted; {stopped}", file=sys.stderr)
        return 130
    except Exception as error:
        original = _unwrap(error)
        if isinstance(original, UserError):
            print(f"vime train: error: {original}", file=sys.stderr)
            return 1
        dead = died_for_good(original)
        if dead is not None:  # e.g. the controller, once Ray's restarts of it are spent
            print(
                f"vime train: error: a process of the run died and was not restarted: {dead}. What the run "
                f"committed is intact; {resume_hint(settings.checkpoint.save)}",
                file=sys.stderr,
            )
            return 1
        if getattr(original, "actor_init_failed", False):  # Ray keeps only the text of such a cause
            print(
                f"vime train: error: a worker failed to start: {str(original).strip().splitlines()[-1]}",
                file=sys.stderr,
            )
            return 1
        raise
