"""What a trainer backend provides: the model, never the objective.

The RL objective (advantages, losses, TIS, score centering, OPD, the critic's value loss) is written once,
in :mod:`vime.rl.objective`; the training loop over a rollout (:class:`vime.backends.rollout_training.RolloutTraining`)
runs it on a backend through the methods below. A backend owns its models (the actor, PPO's critic, the
frozen KL reference), their precision, sharding and parallelism, and their files:

- the model ops the loop calls: :meth:`~TrainerBackend.forward`, :meth:`~TrainerBackend.critic_values`,
  the backward pass's gradient reductions (:meth:`~TrainerBackend.sum_gradients`,
  :meth:`~TrainerBackend.finish_gradients`), hooks around a step and the lock-step passes sharded
  ranks owe each other;
- what the trainer worker calls (workers/trainer_worker.py): :meth:`~TrainerBackend.train_rollout`, weight
  export to the engines (:meth:`~TrainerBackend.hf_named_weights`, :meth:`~TrainerBackend.save_weights`,
  :meth:`~TrainerBackend.export_peer`), checkpoints, and the colocated memory turns
  (:meth:`~TrainerBackend.offload` / :meth:`~TrainerBackend.reload`, the sleep and wake of the trained models).

The torch backend (HF model, FSDP2) and the Megatron backend (megatron-core GPTModel) implement it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vime.rl.batch import Forward, PackedBatch
from vime.sample import Sample


@runtime_checkable
class TrainerBackend(Protocol):
    # ------------------------------------------------------------------ model ops (the training loop)
    def forward(self, model, batch: PackedBatch, *, entropy: str | None = None, heads: bool = False) -> Forward:
        """Log-probs of ``batch``'s targets under ``model`` (the actor's or the reference's) at the sampling
        temperature, as [B, T-1] float32 tensors on the CPU (differentiable when grad is enabled).
        ``entropy``: None, 'metric' (without a graph) or 'loss' (differentiable); ``heads``: also the
        log-probs at the sampler's head ids (``batch.head_ids``)."""

    def critic_values(self, batch: PackedBatch) -> torch.Tensor:
        """PPO's critic: the value of each target's prefix, [B, T-1] (aligned with the log-probs)."""

    def micro_batch_tokens(self, per_gpu: int) -> int:
        """A micro-batch's token budget from a per-GPU one (--max-tokens-per-gpu)."""

    def before_step(self, role, step_id: int, micro_batches: int) -> None:
        """Called before each optimizer step's micro-batches (``role``: the actor's or critic's ModelRole)."""

    def owed_forwards(self, module, packed: list[PackedBatch]) -> None:
        """After a no-gradient pass over ``packed``: the dropped forwards this rank owes the others so that
        their collectives stay in lock step (FSDP's all-gathers); nothing where ranks need none."""

    def owed_backwards(self, module, packed: list[PackedBatch], step: range) -> None:
        """The same for an optimizer step's backward passes."""

    def after_backward(self, role) -> None:
        """After an optimizer step's backward passes, before its gradients are summed: update what those passes
        measured that is not a gradient (the Megatron backend: the MoE routers' expert bias)."""

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Add up the step's gradients over the ranks that trained the same parameters on other data."""

    def finish_gradients(self, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """Complete what parallelism leaves partial and clip by the global norm; returns the norm."""

    # ------------------------------------------------------------------ what the trainer worker calls
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """Train on one rollout batch; returns its metrics."""

    def hf_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights the engines load, HF-named, in the engines' dtype (every rank calls it where it gathers)."""

    def save_weights(self, path: str) -> None:
        """The inference weights as an HF folder an engine reloads."""

    def save_hf(self, path: str) -> None:
        """The final HF model (weights and tokenizer)."""

    def export_peer(self) -> None:
        """What a rank that writes nothing does while another exports (its part of the gather)."""

    def save_training_state(self, path: str) -> None:
        """Everything a resume needs: models, optimizers, RNG, counters."""

    def load_training_state(self, path: str, *, optimizer: bool = True) -> None:
        """Restore what :meth:`save_training_state` wrote. ``optimizer=False`` (--no-load-optim): the models,
        RNG and rollout count only; the optimizers keep their fresh state and the schedules start over."""

    def offload(self) -> None:
        """Release the trainer's device memory while the engines generate (--offload-train)."""

    def reload(self) -> None:
        """Back on the device before training."""
