"""The trainer's ranks, driven as one (docs/parallelism.md).

``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` ranks, one Ray actor each. Every call goes to every
rank, because the ranks meet inside collectives (gradient sums, tensor-parallel gathers, checkpoint
barriers); rank 0's answer is the group's. A rank that fails fails the call at once: the others would wait
for it in their next collective.

When a rank dies, every call raises :class:`TrainerDied`; :meth:`TrainerGroup.restart` then
kills what is left of the group and starts every rank again from the same spec (the driver's
workers/trainer_restart.py decides whether, and restores the state).
"""

from __future__ import annotations

from vime.errors import MemberDied
from vime.workers.calls import wait_all

# Bounds every collective of the run: a rank waits this long for the slowest one (a long checkpoint
# write on rank 0, say) before the group gives up.
COLLECTIVE_TIMEOUT_S = 1800.0
# How long a rank's failed call waits for Ray to report a peer's death (which is what usually made it fail).
DEATH_GRACE_S = 10.0


class TrainerDied(MemberDied, RuntimeError):
    """A rank's process is gone (killed, out of memory, its node lost): the group's state since the
    last checkpoint is lost with it."""


class TrainerGroup:
    def __init__(self, ranks: list, *, spec=None, gpus_per_rank: float = 0, timeout: float = 600.0):
        if not ranks:
            raise ValueError("a trainer group needs at least one rank")
        self.ranks = list(ranks)
        # What start() was given, so that restart() builds the same group again.
        self.spec, self.gpus_per_rank, self.timeout = spec, gpus_per_rank, timeout

    @property
    def leader(self):
        """Rank 0: the one that writes weights and checkpoints and sends NCCL broadcasts."""
        return self.ranks[0]

    @classmethod
    def start(cls, spec, world_size: int, *, gpus_per_rank: float = 0, timeout: float = 600.0) -> TrainerGroup:
        """Start ``world_size`` ranks of ``TrainerWorker(spec)``; with more than one, form their process group
        (rank 0's node serves the rendezvous) and build each rank's backend inside it."""
        group = cls(
            cls._create_ranks(spec, world_size, gpus_per_rank), spec=spec, gpus_per_rank=gpus_per_rank, timeout=timeout
        )
        group._join()
        return group

    @staticmethod
    def _create_ranks(spec, world_size: int, gpus_per_rank: float) -> list:
        import ray

        from vime.workers.trainer_worker import TrainerWorker

        remote = ray.remote(num_cpus=0, num_gpus=gpus_per_rank)(TrainerWorker)
        return [remote.remote(spec, rank=rank, world_size=world_size) for rank in range(world_size)]

    def _join(self) -> None:
        import ray

        if len(self.ranks) > 1:
            address, port = ray.get(self.leader.rendezvous_endpoint.remote(), timeout=self.timeout)
            self._wait(
                [rank.join.remote(address, port, COLLECTIVE_TIMEOUT_S) for rank in self.ranks],
                self.timeout,
                f"forming the trainer's process group ({len(self.ranks)} ranks)",
            )

    def restart(self) -> None:
        """Kill every rank still alive (the survivors of a dead one would wait for it in their next
        collective) and start the group again from the same spec: fresh ranks from --hf-checkpoint,
        whose state the caller then loads. The group object stays the same: whoever holds it (the
        weight synchronisation, the colocated memory) calls the new ranks."""
        if self.spec is None:
            raise ValueError("a trainer group built from existing ranks cannot be restarted")
        self.kill()
        self.ranks = self._create_ranks(self.spec, len(self.ranks), self.gpus_per_rank)
        self._join()
        self.ready()

    # ------------------------------------------------------------------ named calls (every rank)
    def ready(self) -> None:
        """Wait until every rank has built its backend (loaded --hf-checkpoint)."""
        self._wait([rank.ready.remote() for rank in self.ranks], self.timeout, "starting the trainer")

    def train_rollout(
        self, rollout_id: int, groups: list, policy_version: int, lineage=None, rollout_time: float = 0.0
    ) -> dict:
        """One step on ``groups``; no time bound (a step's length is the user's)."""
        return self._wait(
            [
                rank.train_rollout.remote(
                    rollout_id, groups, policy_version, lineage=lineage, rollout_time=rollout_time
                )
                for rank in self.ranks
            ],
            None,
            f"training step {rollout_id + 1}",
        )

    def log_rollout(self, rollout_id: int, groups: list, rollout_time: float, defaults: list[str]) -> dict:
        """--custom-rollout-log-function-path on a step no rank trains (rank 0 holds the hook); no time bound (the
        hook's length is the user's)."""
        return self._wait(
            [self.ranks[0].log_rollout.remote(rollout_id, groups, rollout_time, defaults)],
            None,
            f"logging rollout {rollout_id + 1}",
        )

    def load_checkpoint(self, folder: str, *, optimizer: bool = True, timeout: float = 3600.0) -> None:
        """Every rank loads its part of ``folder``; ``optimizer=False`` (--no-load-optim): not the optimizers."""
        self._wait(
            [rank.load_checkpoint.remote(folder, optimizer=optimizer) for rank in self.ranks],
            timeout,
            f"loading {folder}",
        )

    def save_checkpoint(self, folder: str, *, timeout: float = 3600.0) -> None:
        """Every rank writes its part of the training state (rank 0 the shared files) into ``folder``."""
        self._wait([rank.save_checkpoint.remote(folder) for rank in self.ranks], timeout, f"saving {folder}")

    def save_hf(self, folder: str, *, timeout: float = 3600.0) -> None:
        """The model in Hugging Face format (gathered; rank 0 writes)."""
        self._wait([rank.save_hf.remote(folder) for rank in self.ranks], timeout, f"saving {folder}")

    def publish_weights(self, version: int, *, mode: str, full_interval: int, force_full: bool, timeout: float | None):
        """Write weight version ``version`` for the engines (docs/weights.md); rank 0's Publication."""
        return self._wait(
            [
                rank.publish_weights.remote(version, mode=mode, full_interval=full_interval, force_full=force_full)
                for rank in self.ranks
            ],
            timeout,
            f"publishing weight version {version}",
        )

    def offload_memory(self, *, timeout: float | None) -> None:
        self._wait([rank.offload_memory.remote() for rank in self.ranks], timeout, "offloading the trainer's memory")

    def reload_memory(self, *, timeout: float | None) -> None:
        self._wait([rank.reload_memory.remote() for rank in self.ranks], timeout, "reloading the trainer's memory")

    # NCCL weight broadcasts start on the trainer and on the engines at once: these return the object refs
    # (rank 0's first) for the caller to wait on together with the engines'.
    def start_nccl_open(self, address: str, port: int, world_size: int) -> list:
        return [rank.nccl_open.remote(address, port, world_size) for rank in self.ranks]

    def start_nccl_send(self) -> list:
        return [rank.nccl_send.remote() for rank in self.ranks]

    def shutdown(self, *, timeout: float = 10.0) -> None:
        """Close every rank's queue readers, weight publisher and NCCL group (the teardown's first step for
        the trainer; the processes are stopped with Ray)."""
        self._wait([rank.shutdown.remote() for rank in self.ranks], timeout, "shutting the trainer down")

    def _wait(self, refs: list, timeout: float | None, what: str):
        """Rank 0's result of calls on every rank; a dead rank raises TrainerDied at once."""
        import ray

        try:
            return wait_all(refs, timeout, what)[0]
        except ray.exceptions.RayActorError as error:
            raise TrainerDied(f"a trainer rank died while {what}: {error}") from error
        except ray.exceptions.RayTaskError as error:
            # A rank whose peer died fails its collective first (gloo: "Connection reset by peer"), before Ray
            # reports the peer's death: the death is the cause, not the survivor's error.
            dead = self._dead_rank(refs)
            if dead is not None:
                raise TrainerDied(f"a trainer rank died while {what}: {dead}") from error
            raise

    @staticmethod
    def _dead_rank(refs: list, grace: float = DEATH_GRACE_S):
        """The RayActorError of a rank that died, among ``refs``, waiting up to ``grace`` seconds for Ray to
        report it; None when every rank is alive."""
        import ray

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as error:
                return error
            except Exception:  # noqa: BLE001 - another rank's own error: not a death
                continue
        return None

    def kill(self) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank)
