"""The trainer's ranks, driven as one (docs/parallelism.md).

``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` ranks, one Ray actor each. Every call goes to every
rank, because the ranks meet inside collectives (gradient sums, tensor-parallel gathers, checkpoint
barriers); rank 0's answer is the group's. A rank that fails fails the call at once: the others would wait
for it in their next collective.
"""

from __future__ import annotations

from vime.workers.calls import wait_all

# Bounds every collective of the run: a rank waits this long for the slowest one (a long checkpoint
# write on rank 0, say) before the group gives up.
COLLECTIVE_TIMEOUT_S = 1800.0


class TrainerGroup:
    def __init__(self, ranks: list):
        if not ranks:
            raise ValueError("a trainer group needs at least one rank")
        self.ranks = list(ranks)

    @property
    def leader(self):
        """Rank 0: the one that writes weights and checkpoints and sends NCCL broadcasts."""
        return self.ranks[0]

    @classmethod
    def start(cls, spec, world_size: int, *, gpus_per_rank: float = 0, timeout: float = 600.0) -> "TrainerGroup":
        """Start ``world_size`` ranks of ``TrainerWorker(spec)``; with more than one, form their process group
        (rank 0's node serves the rendezvous) and build each rank's backend inside it."""
        import ray

        from vime.workers.trainer_worker import TrainerWorker

        remote = ray.remote(num_cpus=0, num_gpus=gpus_per_rank)(TrainerWorker)
        ranks = [remote.remote(spec, rank=rank, world_size=world_size) for rank in range(world_size)]
        group = cls(ranks)
        if world_size > 1:
            address, port = ray.get(group.leader.rendezvous_endpoint.remote(), timeout=timeout)
            group.run("join", address, port, COLLECTIVE_TIMEOUT_S, timeout=timeout,
                      what=f"forming the trainer's process group ({world_size} ranks)")
        return group

    def call(self, method: str, *args, **kwargs) -> list:
        """``method`` started on every rank; the object refs, rank 0's first."""
        return [getattr(rank, method).remote(*args, **kwargs) for rank in self.ranks]

    def run(self, method: str, *args, timeout: float | None, what: str | None = None, **kwargs):
        """``method`` on every rank, waited for (the first failure raised at once); rank 0's result."""
        refs = self.call(method, *args, **kwargs)
        return wait_all(refs, timeout, what or f"the trainer's {method}")[0]

    def kill(self) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank)
