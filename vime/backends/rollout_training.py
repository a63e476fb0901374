"""The training loop over one rollout batch, shared by the trainer backends.

:class:`RolloutTraining` runs the RL objective (:class:`vime.rl.objective.RLObjective`) on a backend's
models through the model ops of :class:`vime.backends.protocol.TrainerBackend`: the no-gradient forwards
(old policy, reference, critic values), the advantages, then one optimizer step per global batch of
the critic and of the actor, data-parallel ranks sharing each step's micro-batches. The torch and
Megatron backends subclass it and implement the model ops; the loop knows neither the model nor the loss.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import time

import numpy as np
import torch

from vime.backends.micro_batches import BatchLayout, assign_to_ranks, dynamic_layout, fixed_layout, over_budget, regroup
from vime.errors import UserError
from vime.rl.batch import Forward, PackedBatch, pack
from vime.rl.objective import RLObjective
from vime.sample import Sample

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def use_deterministic_algorithms() -> None:
    """--deterministic-mode: from now on this process runs only deterministic kernels (an op without one raises,
    naming itself). cuBLAS needs its workspace size fixed before CUDA starts for that (torch's documentation):
    set here unless the user's environment already chose one."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _relayout(
    values: list[torch.Tensor | None],
    source: list[PackedBatch],
    target: list[PackedBatch],
    source_ids: list[list[int]],
    target_ids: list[list[int]],
) -> list[torch.Tensor | None]:
    """Per-micro-batch [B, T-1] values moved from the ``source`` micro-batches to the ``target`` ones (which
    hold the same samples, grouped differently). Only the response positions carry over (0 elsewhere): the
    loss reads nothing else."""
    if all(v is None for v in values):
        return [None] * len(target)
    rows = [batch.rows(v) for batch, v in zip(source, values)]
    return [batch.unrows(r) for batch, r in zip(target, regroup(rows, source_ids, target_ids))]


def debug_train_data(samples, packed, old, ref, values, advantages, returns) -> dict:
    """--save-debug-train-data: the step's training data, per-sample lists in rollout order (None where the
    run computes no such value), over the response tokens except ``tokens``."""

    def rows(per_batch):
        if any(v is None for v in per_batch):
            return None
        return [row.detach().cpu() for b, v in zip(packed, per_batch) for row in b.rows(v)]

    return {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "rewards": [s.reward for s in samples],
        "sample_indices": [(s.group_index, s.index) for s in samples],
        "loss_masks": [row.cpu() for b in packed for row in b.rows(b.response_mask)],
        "rollout_log_probs": [row.cpu() for b in packed for row in b.rows(b.rollout_log_probs)],
        "log_probs": rows(old),
        "ref_log_probs": rows(ref),
        "values": rows(values),
        "advantages": rows(advantages),
        "returns": rows(returns),
    }


class NonFiniteStep(UserError, RuntimeError):
    """A step's loss or gradient norm is NaN or infinite (Megatron-LM's --check-for-nan-in-loss-and-grad)."""


def check_finite_step(role: str, step_id: int, loss: float, grad_norm: float) -> None:
    """Refuse an optimizer step whose loss or gradient norm is not finite, before it is taken: stepping would
    write NaN into the weights, the engines and the next checkpoint. Every data-parallel rank sees the same summed
    loss and global norm, so every rank raises alike."""
    bad = [
        f"{name} is {value}"
        for name, value in (("loss", loss), ("gradient norm", grad_norm))
        if not math.isfinite(value)
    ]
    if bad:
        raise NonFiniteStep(
            f"the {role}'s optimizer step {step_id + 1} of this rollout: the {' and the '.join(bad)}. The step was "
            "not taken and the run stops before the rollout is committed; look at --lr, --clip-grad and the "
            "rollout's rewards, then --load resumes from the last checkpoint (--no-check-for-nan-in-loss-and-grad "
            "trains on regardless, as Megatron-LM's flag of that name)"
        )


class RolloutTraining:
    """The loop of :meth:`train_rollout`. A subclass sets, in its constructor: ``spec`` (the trainer spec),
    ``objective``, ``dp`` (DataParallel), ``model`` / ``ref_model`` (what :meth:`forward` runs), ``actor`` and
    ``critic`` (ModelRoles; critic None without PPO), ``pad_id`` and ``rollouts_trained``; and implements the
    model ops of :class:`~vime.backends.protocol.TrainerBackend`."""

    objective: RLObjective

    # ------------------------------------------------------------------ model ops (the backend's)
    def forward(self, model, batch: PackedBatch, *, entropy: str | None = None, heads: bool = False) -> Forward:
        raise NotImplementedError

    def critic_values(self, batch: PackedBatch) -> torch.Tensor:
        raise NotImplementedError

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def finish_gradients(self, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        raise NotImplementedError

    def micro_batch_tokens(self, per_gpu: int) -> int:
        """A micro-batch's token budget from a per-GPU one (the Megatron backend: x its context-parallel ranks,
        which each hold a part of every sequence)."""
        return per_gpu

    def before_step(self, role, step_id: int, micro_batches: int) -> None:
        """Called before each optimizer step's micro-batches (the Megatron backend runs its hooks here)."""

    def micro_batch_multiple(self) -> int:
        """With token budgets, the number every pass's micro-batch count is made a multiple of, and with
        --balance-data every rank gets as many micro-batches as the others: 1 (no constraint) unless the
        data-parallel ranks exchange tokens inside the model (the Megatron backend's expert parallelism)."""
        return 1

    def owed_forwards(self, module, packed: list[PackedBatch]) -> None:
        """Ranks that keep no collectives in lock step owe nothing (FSDP does: the torch backend)."""

    def owed_backwards(self, module, packed: list[PackedBatch], step: range) -> None:
        """As :meth:`owed_forwards`, for a step's backward passes."""

    def after_backward(self, role) -> None:
        """Nothing but gradients to update after a step's backward passes (the Megatron backend: expert biases)."""

    # The names the tests (and older callers) use for the model ops and the objective's advantages.
    def _forward(self, model, batch: PackedBatch, **kwargs) -> Forward:
        return self.forward(model, batch, **kwargs)

    def _values(self, batch: PackedBatch) -> torch.Tensor:
        return self.critic_values(batch)

    def _advantages(self, samples, packed, old, ref, values, metrics):
        return self.objective.advantages(samples, packed, old, ref, values, metrics)

    # ------------------------------------------------------------------ colocated memory (--offload-train)
    def offload(self) -> None:
        """Release the trainer's device memory while the engines generate: the actor's parameters and
        optimizer state move to host memory (on a CPU trainer only its gradients are freed), and so does
        the reference model."""
        self.actor.sleep()
        if self.ref_model is not None and self.actor.device.type != "cpu":
            self.ref_model.to("cpu")

    def reload(self) -> None:
        """Before training: back to the device :meth:`offload` moved from."""
        self.actor.wake()
        if self.ref_model is not None and self.actor.device.type != "cpu":
            self.ref_model.to(self.actor.device)

    # ------------------------------------------------------------------ the objective's passes
    def _log_probs(self, batch: PackedBatch) -> torch.Tensor:
        """The actor's (old policy) log-probs of ``batch``."""
        return self.objective.old_log_probs(
            batch, self.forward(self.model, batch, heads=self.objective.old_heads(batch))
        )

    def _micro_batch_loss(
        self,
        batch: PackedBatch,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor | None,
        totals: dict,
        step_terms: dict,
        metrics: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step loss (micro-batch losses add up to the step's), and its log-probs."""
        out = self.forward(self.model, batch, entropy=self.objective.train_entropy, heads=self.objective.train_heads)
        return self.objective.policy_loss(batch, out, old, ref, advantages, totals, step_terms, metrics)

    def _value_loss(
        self, batch: PackedBatch, old_values: torch.Tensor, returns: torch.Tensor, totals: dict, metrics: dict
    ) -> torch.Tensor:
        """The micro-batch's share of the step's clipped value loss."""
        return self.objective.value_loss(batch, self.critic_values(batch), old_values, returns, totals, metrics)

    def _in_lock_step(self, module, packed: list[PackedBatch], values: list) -> list:
        """``values`` of a no-gradient pass over ``packed`` (this rank's computed, None elsewhere), after the
        dropped forwards of ``module`` this rank owes (:meth:`owed_forwards`)."""
        self.owed_forwards(module, packed)
        return values

    # ------------------------------------------------------------------ micro-batches
    def _batch_layout(self, samples: list[Sample]) -> BatchLayout:
        """Which samples each micro-batch holds (vime.backends.micro_batches): --micro-batch-size samples, or
        with --use-dynamic-batch-size each step's samples packed by the token budgets."""
        spec = self.spec
        if not spec.use_dynamic_batch_size:
            return fixed_layout(len(samples), spec.micro_batch_size, spec.global_batch_size)
        lengths = [len(s.tokens) for s in samples]
        budget = self.micro_batch_tokens(spec.max_tokens_per_gpu)
        forward_budget = self.micro_batch_tokens(spec.log_probs_max_tokens_per_gpu or spec.max_tokens_per_gpu)
        longer = over_budget(lengths, budget)
        if longer:  # trained anyway (alone in its micro-batch): the budget is a packing target, not a cut
            logger.warning(
                "%d sample(s) of this rollout are longer than --max-tokens-per-gpu %d (the longest: %d "
                "tokens); each trains in a micro-batch of its own",
                len(longer),
                spec.max_tokens_per_gpu,
                max(lengths[i] for i in longer),
            )
        return dynamic_layout(
            lengths, spec.global_batch_size, budget, forward_budget, multiple=self.micro_batch_multiple()
        )

    def _training_batches(
        self,
        samples: list[Sample],
        loss_masks: list[list[int]],
        layout: BatchLayout,
        forward: list[PackedBatch],
        per_forward: tuple,
    ) -> tuple[list[PackedBatch], list[list]]:
        """The training micro-batches of ``layout`` and, moved into them, the per-micro-batch [B, T-1] results of
        the no-gradient forwards (``per_forward``: lists over ``forward``, or lists of None)."""
        packed = [
            pack(
                [samples[i] for i in ids],
                self.pad_id,
                [loss_masks[i] for i in ids],
                with_heads=self.spec.algorithm.use_score_centering,
            )
            for ids in layout.train
        ]
        moved = [_relayout(values, forward, packed, layout.forward, layout.train) for values in per_forward]
        return packed, moved

    def _my_micro_batches(self, packed: list[PackedBatch], step: range) -> list[int]:
        """This data-parallel rank's micro-batches of one optimizer step: round-robin, or with --balance-data
        by token count (every rank computes the same assignment; one left without any still joins the sums)."""
        if not self.spec.balance_data or self.dp.size == 1:
            return self.dp.share(step)
        owners = assign_to_ranks(
            [int(packed[i].attention_mask.sum()) for i in step],
            self.dp.size,
            equal_counts=self.micro_batch_multiple() > 1,
        )
        return [i for i, owner in zip(step, owners) if owner == self.dp.rank]

    # ------------------------------------------------------------------ one rollout
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """:meth:`train_samples` on the samples the objective makes of ``samples``
        (--custom-convert-samples-to-train-data-path, :meth:`RLObjective.train_samples`)."""
        return self.train_samples(self.objective.train_samples(samples), policy_version)

    def train_samples(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """Advantages over the rollout, then one optimizer step per global batch.

        ``policy_version`` (the version of the weights being trained) lets the metrics compare the
        sampler's log-probs with the trainer's on the samples generated entirely by those weights:
        ``onpolicy_logprob_abs_diff`` is ~0 exactly when the engines serve what the trainer holds.
        It is also the version --mask-offpolicy-in-partial-rollout keeps.

        With PPO the critic computes the values, GAE the advantages and returns, the critic trains on
        the returns and then (after --num-critic-only-steps rollouts) the actor on the advantages.
        """
        started = time.perf_counter()
        objective = self.objective
        algo = objective.algorithm
        objective.check_samples(samples)
        loss_masks = objective.loss_masks(samples, policy_version)
        masked_offpolicy = sum(
            sum(s.loss_mask or [1] * s.response_length) - sum(m) for s, m in zip(samples, loss_masks)
        )
        layout = self._batch_layout(samples)
        micro_batches = [[samples[i] for i in ids] for ids in layout.train]
        # First the no-gradient forwards' micro-batches (rollout order: the advantages need it).
        packed = [
            pack(
                [samples[i] for i in ids],
                self.pad_id,
                [loss_masks[i] for i in ids],
                with_heads=algo.use_score_centering,
                with_teacher=algo.use_opd,
            )
            for ids in layout.forward
        ]
        metrics: dict[str, list[float]] = collections.defaultdict(list)
        # SFT needs none of these: no old policy, reference or advantages.
        old, ref, advantages = [None] * len(packed), [None] * len(packed), [None] * len(packed)
        values, returns = [None] * len(packed), [None] * len(packed)
        if algo.policy_loss != "sft":
            self.actor.wake()
            mine = [self.dp.owns(i) for i in range(len(packed))]
            with torch.no_grad():
                self.model.eval()
                if algo.use_rollout_logprobs:
                    old = [b.rollout_log_probs for b in packed]
                else:
                    old = self.dp.fill(
                        self._in_lock_step(
                            self.model, packed, [self._log_probs(b) if m else None for b, m in zip(packed, mine)]
                        )
                    )
                self.model.train()
                if self.ref_model is not None:
                    ref = self.dp.fill(
                        self._in_lock_step(
                            self.ref_model,
                            packed,
                            [self.forward(self.ref_model, b).log_probs if m else None for b, m in zip(packed, mine)],
                        )
                    )
            if self.critic is not None:
                self.actor.sleep()
                self.critic.wake()
                with torch.no_grad():
                    self.critic.module.eval()
                    values = self.dp.fill(
                        self._in_lock_step(
                            self.critic.module,
                            packed,
                            [self.critic_values(b) if m else None for b, m in zip(packed, mine)],
                        )
                    )
                    self.critic.module.train()
            advantages, returns = self._advantages(samples, packed, old, ref, values, metrics)
        hooks = self.spec.hooks
        if hooks is not None and hooks.save_debug_train_data:
            self.last_train_data = debug_train_data(samples, packed, old, ref, values, advantages, returns)
        if layout.train != layout.forward:  # token budgets pack training apart from the forwards
            packed, (old, ref, values, advantages, returns) = self._training_batches(
                samples, loss_masks, layout, packed, (old, ref, values, advantages, returns)
            )

        steps = layout.step_ranges()
        if self.critic is not None:
            self._optimizer_steps(
                self.critic,
                packed,
                steps,
                metrics,
                loss_key="value_loss",
                grad_key="critic_grad_norm",
                micro_loss=lambda i, totals, terms: self._value_loss(packed[i], values[i], returns[i], totals, metrics),
            )
            self.critic.sleep()
        train_actor = self.critic is None or self.rollouts_trained >= algo.num_critic_only_steps
        self.actor.wake()
        if train_actor:
            on_policy = objective.on_policy(micro_batches, policy_version)

            def actor_loss(i: int, totals: dict, step_terms: dict) -> torch.Tensor:
                loss, log_probs = self._micro_batch_loss(
                    packed[i], old[i], ref[i], advantages[i], totals, step_terms, metrics
                )
                objective.logprob_metrics(packed[i], log_probs, on_policy[i], metrics)
                return loss

            self._optimizer_steps(
                self.actor, packed, steps, metrics, loss_key="loss", grad_key="grad_norm", micro_loss=actor_loss
            )
        self.rollouts_trained += 1
        metrics = self.dp.merge_metrics(metrics)
        elapsed = time.perf_counter() - started
        result = objective.summarize(metrics)
        result["train_tokens"] = float(sum(len(s.tokens) for s in samples))
        result["train_seconds"] = elapsed
        result["optimizer_steps"] = float(len(steps)) if train_actor else 0.0
        result["train_micro_batches"] = float(len(packed))
        result["train_max_micro_batch_tokens"] = float(
            max((sum(len(s.tokens) for s in mb) for mb in micro_batches), default=0)
        )
        if self.critic is not None:
            result["critic_only"] = float(not train_actor)
        if algo.mask_offpolicy_in_partial_rollout:
            result["offpolicy_masked_tokens"] = float(masked_offpolicy)
        return result

    def _optimizer_steps(
        self,
        role,
        packed: list[PackedBatch],
        step_ranges: list[range],
        metrics: dict,
        *,
        loss_key: str,
        grad_key: str,
        micro_loss,
    ) -> None:
        """One optimizer step of ``role`` per range of micro-batches; ``micro_loss(i, totals, step_terms)``
        returns micro-batch i's share of the step loss (micro-batch losses add up to the step's). Data-parallel
        ranks each run their share of a step's micro-batches and add up their gradients."""
        for step_id, steps in enumerate(step_ranges):
            totals = {
                "num_samples": sum(packed[i].input_ids.shape[0] for i in steps),
                "num_tokens": float(sum(packed[i].response_mask.sum() for i in steps)),
            }
            self.before_step(role, step_id, len(steps))
            role.optimizer.zero_grad(set_to_none=True)
            # Loss terms are each micro-batch's share of the step's value: they add up over the step.
            step_terms: dict[str, float] = collections.defaultdict(float)
            for i in self._my_micro_batches(packed, steps):
                loss = micro_loss(i, totals, step_terms)
                loss.backward()
                step_terms[loss_key] += float(loss.detach())
            self.owed_backwards(role.module, packed, steps)
            self.after_backward(role)
            step_terms = self.dp.sum_terms(step_terms)
            params = [p for p in role.parameters() if p.requires_grad]
            self.sum_gradients(params)
            grad_norm = float(self.finish_gradients(params, role.clip_grad))
            if self.spec.check_for_nan_in_loss_and_grad:
                check_finite_step(role.name, step_id, step_terms[loss_key], grad_norm)
            metrics[role.lr_key].append(role.step())
            for name, value in step_terms.items():
                metrics[name].append(value)
            metrics[grad_key].append(grad_norm)
