"""The RL objective, written once for every trainer backend.

:class:`RLObjective` turns a rollout's samples, the backends' forward passes (:class:`~vime.rl.batch.Forward`)
and the critic's values into advantages, per-micro-batch loss terms and metrics: the policy losses
(PPO, GSPO, CISPO, REINFORCE, SFT), KL terms, TIS, score centering, top-p replay, OPD and PPO's clipped
value loss. It never runs a model: the backend (vime/backends/protocol.py) computes the forward passes
on its model, in its precision and sharding, and does the backward passes and optimizer steps. This
module imports no backend, so that precision, sharding and batching stay properties of the backend.

Conventions shared with the training loop:

- per-micro-batch values are [B, T-1] tensors in the micro-batch's layout (:class:`PackedBatch`);
- a micro-batch's loss is its share of the optimizer step's loss (``totals``: the step's sample and
  token counts, see :func:`vime.rl.losses.reduce_loss`), so micro-batch losses add up to the step's;
- ``step_terms`` collects loss terms (shares of the step's value), ``metrics`` lists of token averages.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from vime.config.algorithm import AlgorithmConfig
from vime.config.hooks import HooksConfig
from vime.rl.advantages import compute_advantages, ppo_advantages_and_returns, whiten_ragged
from vime.rl.batch import Forward, PackedBatch, masked_mean, replay_support
from vime.rl.kl import approx_kl
from vime.rl.losses import (
    cispo_loss,
    clipped_value_loss,
    gspo_loss,
    nll_loss,
    ppo_clip_loss,
    reduce_loss,
    reinforce_loss,
    sequence_log_ratio,
)
from vime.rl.offpolicy import onpolicy_loss_mask
from vime.rl.opd import opd_advantages
from vime.rl.score_centering import sampled_importance_weight, support_correction, topk_correction, weighting
from vime.rl.tis import load_tis_function
from vime.rl.user_hooks import UserHooks
from vime.sample import Sample

# Metrics reduced over the rollout's micro-batches (and ranks) by their maximum; the others by their mean.
MAX_METRICS = frozenset({"train_rollout_logprob_abs_diff_max"})


class RLObjective:
    """The objective of ``algorithm`` (the --advantage-estimator, loss, KL, TIS, ... flags).

    ``n_samples_per_prompt`` sizes the group baselines; ``rollout_temperature`` and ``hf_checkpoint``
    only reach user functions, whose ``args`` are the algorithm's flags plus these, the ``hooks`` flags
    (vime.config.hooks) and the keys of --custom-config-path (``custom_config``), as the reference
    framework's ``args``.
    """

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        *,
        n_samples_per_prompt: int,
        rollout_temperature: float,
        hf_checkpoint: str,
        hooks: HooksConfig | None = None,
        custom_config: dict | None = None,
    ):
        self.algorithm = algorithm
        self.n_samples_per_prompt = n_samples_per_prompt
        algo = algorithm
        self.tis_function = load_tis_function(algo.custom_tis_function_path) if algo.use_tis else None
        self.user = UserHooks(
            algo,
            n_samples_per_prompt=n_samples_per_prompt,
            rollout_temperature=rollout_temperature,
            hf_checkpoint=hf_checkpoint,
            hooks=hooks,
            custom_config=custom_config,
        )
        self.sc_weighting = (
            weighting(algo.use_tis, algo.custom_tis_function_path, algo.tis_clip_low, algo.tis_clip)
            if algo.use_score_centering
            else None
        )

    # ------------------------------------------------------------------ what the forwards must return
    @property
    def train_entropy(self) -> str:
        """The entropy the training forward computes: 'loss' (differentiable, --entropy-coef) or 'metric'."""
        return "loss" if self.algorithm.entropy_coef else "metric"

    @property
    def train_heads(self) -> bool:
        """Whether the training forward also returns the log-probs at the sampler's head ids (score centering)."""
        return self.algorithm.use_score_centering

    @staticmethod
    def old_heads(batch: PackedBatch) -> bool:
        """Whether the old policy's forward needs the head log-probs: top-p replay normalises on the support."""
        return batch.head_valid is not None

    @staticmethod
    def old_log_probs(batch: PackedBatch, out: Forward) -> torch.Tensor:
        """The old policy's log-probs from its forward (normalised on the recorded top-p support, if any)."""
        return replay_support(batch, out).log_probs

    # ------------------------------------------------------------------ the rollout
    def check_samples(self, samples: list[Sample]) -> None:
        algo = self.algorithm
        if algo.use_tis or algo.use_rollout_logprobs or algo.use_score_centering:
            missing = next((s for s in samples if s.rollout_log_probs is None), None)
            if missing is not None:
                raise ValueError(
                    f"sample {missing.index} of group {missing.group_index} has no rollout_log_probs, "
                    "which --use-tis, --use-rollout-logprobs and --use-score-centering need"
                )

    def train_samples(self, samples: list[Sample]) -> list[Sample]:
        """The samples the trainer trains on (--custom-convert-samples-to-train-data-path: UserHooks.train_samples)."""
        return self.user.train_samples(samples)

    @property
    def hook_args(self) -> argparse.Namespace:
        """What user functions receive as ``args`` (vime.rl.user_hooks)."""
        return self.user.args

    def loss_masks(self, samples: list[Sample], policy_version: int | None) -> list[list[int]]:
        """Each sample's trained tokens: its own loss mask, less (--mask-offpolicy-in-partial-rollout) the
        tokens generated by other weights than ``policy_version``."""
        masks = [list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length for s in samples]
        if not self.algorithm.mask_offpolicy_in_partial_rollout:
            return masks
        if policy_version is None:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs the policy version being trained")
        return [onpolicy_loss_mask(mask, s.weight_versions, policy_version) for mask, s in zip(masks, samples)]

    @staticmethod
    def on_policy(micro_batches: list[list[Sample]], policy_version: int | None) -> list[torch.Tensor]:
        """Per micro-batch, [B, 1]: 1 for the samples generated entirely by the weights being trained."""
        return [
            torch.tensor(
                [
                    float(
                        bool(s.weight_versions) and min(s.weight_versions) == policy_version == max(s.weight_versions)
                    )
                    for s in mb
                ]
            ).unsqueeze(1)
            for mb in micro_batches
        ]

    def advantages(
        self,
        samples: list[Sample],
        packed: list[PackedBatch],
        old: list[torch.Tensor],
        ref: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
        metrics: dict,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Token advantages of the whole rollout (whitening and group baselines span micro-batches) and,
        with PPO, the critic's returns, both in each micro-batch's [B, T-1] layout."""
        algo = self.algorithm
        if not algo.computes_advantages:  # --disable-compute-advantages-and-returns
            return [None] * len(packed), [None] * len(packed)
        if any(s.reward is None for s in samples):
            missing = next(s for s in samples if s.reward is None)
            raise ValueError(f"sample {missing.index} of group {missing.group_index} has no reward")
        masks = [row for b in packed for row in b.rows(b.response_mask)]
        kl = None
        if algo.kl_coef:
            # Reward shaping compares the policy that generated the batch (old log-probs) with the reference.
            kl = [row for b, o, r in zip(packed, old, ref) for row in b.rows(approx_kl(o, r, algo.kl_loss_type))]
        rewards = torch.tensor([float(s.reward) for s in samples])
        # Group normalisation: not of rewards a hook made (post-process, conversion), nor without it.
        group_baseline = self.user.convert_samples is None and not algo.disable_rewards_normalization
        if self.user.reward_post_process is not None:
            rewards, group_baseline = self.user.post_processed_rewards(samples), False
        token_returns = None
        if self.user.advantage_function is not None:
            token_advantages, token_returns = self.user.advantages(
                samples, packed, old, ref, values, masks, kl, rewards, group_baseline
            )
        elif algo.uses_critic:
            value_rows = [row for b, v in zip(packed, values) for row in b.rows(v)]
            token_advantages, token_returns = ppo_advantages_and_returns(
                rewards, value_rows, masks, kl=kl, kl_coef=algo.kl_coef, gamma=algo.gamma, lambd=algo.lambd
            )
        else:
            token_advantages = compute_advantages(
                algo.advantage_estimator,
                rewards,
                masks,
                group_size=self.n_samples_per_prompt,
                kl=kl,
                kl_coef=algo.kl_coef,
                gamma=algo.gamma,
                lambd=algo.lambd,
                normalize_std=not algo.disable_grpo_std_normalization,
                normalize=False,
                group_baseline=group_baseline,
            )
        if algo.use_opd:
            student = [row for b, o in zip(packed, old) for row in b.rows(o)]
            teacher = [row for b in packed for row in b.rows(b.teacher_log_probs)]
            token_advantages, reverse_kl = opd_advantages(
                token_advantages, student, teacher, masks, kl_coef=algo.opd_kl_coef
            )
            flat_mask = torch.cat(masks) if masks else torch.zeros(0)
            metrics["opd_reverse_kl"].append(masked_mean(torch.cat(reverse_kl) if reverse_kl else flat_mask, flat_mask))
        if algo.normalize_advantages:
            token_advantages = whiten_ragged(token_advantages, masks)
        out, out_returns, first = [], [], 0
        for b in packed:
            out.append(b.unrows(token_advantages[first : first + len(b.starts)]))
            out_returns.append(
                None if token_returns is None else b.unrows(token_returns[first : first + len(b.starts)])
            )
            first += len(b.starts)
        return out, out_returns

    # ------------------------------------------------------------------ one micro-batch
    def policy_loss(
        self,
        batch: PackedBatch,
        out: Forward,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor | None,
        totals: dict,
        step_terms: dict,
        metrics: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step loss, from the training forward ``out`` (computed with
        :attr:`train_entropy` and :attr:`train_heads`), and its log-probs."""
        algo = self.algorithm
        mask = batch.response_mask
        reduce = functools.partial(reduce_loss, per_token_loss=algo.calculate_per_token_loss, **totals)
        kind = algo.policy_loss
        out = replay_support(batch, out)
        log_probs = out.log_probs
        if kind == "sft":
            loss = reduce(nll_loss(log_probs), mask)
            metrics["entropy"].append(masked_mean(out.entropy, mask))
            return loss, log_probs
        if kind == "custom":
            return self.user.policy_loss(batch, out, old, ref, advantages, totals, metrics), log_probs

        if kind == "gspo":
            per_token, clipped = gspo_loss(
                log_probs, old, advantages, mask, eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high
            )
            ppo_kl = -sequence_log_ratio(log_probs.detach(), old, mask).expand_as(log_probs)
        else:
            if kind == "ppo":
                per_token, clipped = ppo_clip_loss(
                    log_probs,
                    old,
                    advantages,
                    eps_clip=algo.eps_clip,
                    eps_clip_high=algo.eps_clip_high,
                    eps_clip_c=algo.eps_clip_c,
                )
            elif kind == "cispo":
                per_token, clipped = cispo_loss(
                    log_probs, old, advantages, eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high
                )
            else:
                per_token, clipped = reinforce_loss(log_probs, advantages), torch.zeros_like(log_probs)
            ppo_kl = old - log_probs.detach()
        if self.tis_function is not None:
            # REINFORCE has no old policy in its objective: its weight compares the current trainer (detached).
            trainer = log_probs.detach() if kind == "reinforce" else old
            per_token = self.apply_tis(batch, per_token, trainer, metrics)
        if algo.use_score_centering:
            per_token = per_token + advantages.detach() * self.score_centering(batch, out, log_probs, metrics)

        if self.user.pg_loss_reducer is not None:
            pg_loss = self.user.pg_loss(batch, per_token, totals)
        else:
            pg_loss = reduce(per_token, mask)
        entropy_loss = reduce(out.entropy, mask)
        loss = pg_loss - algo.entropy_coef * entropy_loss if algo.entropy_coef else pg_loss
        if ref is not None:
            # --use-unbiased-kl: each token's estimate weighted by pi_theta / pi_old (with its gradient).
            ratio = torch.exp(log_probs - old) if algo.use_kl_loss and algo.use_unbiased_kl else None
            kl = approx_kl(log_probs if algo.use_kl_loss else log_probs.detach(), ref, algo.kl_loss_type, ratio)
            if algo.use_kl_loss:
                kl_loss = reduce(kl, mask)
                step_terms["kl_loss"] += float(kl_loss.detach())
                if algo.kl_loss_coef:
                    loss = loss + algo.kl_loss_coef * kl_loss
            metrics["kl"].append(masked_mean(kl, mask))
        step_terms["pg_loss"] += float(pg_loss.detach())
        metrics["entropy"].append(masked_mean(out.entropy, mask))
        metrics["pg_clipfrac"].append(masked_mean(clipped, mask))
        metrics["ppo_kl"].append(masked_mean(ppo_kl, mask))
        return loss, log_probs

    def apply_tis(
        self, batch: PackedBatch, per_token: torch.Tensor, trainer_log_probs: torch.Tensor, metrics: dict
    ) -> torch.Tensor:
        """Weight the per-token loss with the TIS function; tokens it rejects leave the numerator only."""
        masks = batch.rows(batch.response_mask)
        pg_loss, new_masks, tis_metrics = self.tis_function(
            self.user.args,
            pg_loss=torch.cat(batch.rows(per_token)),
            train_log_probs=batch.rows(trainer_log_probs),
            rollout_log_probs=batch.rows(batch.rollout_log_probs),
            loss_masks=masks,
            total_lengths=[start + 1 + n for start, n in zip(batch.starts, batch.lengths)],
            response_lengths=list(batch.lengths),
        )
        weighted = batch.unrows(list(pg_loss.split(batch.lengths)))
        if new_masks is not masks:
            weighted = weighted * batch.unrows([m.to(weighted.dtype) for m in new_masks])
        flat_mask = torch.cat(masks)
        for name, values in tis_metrics.items():
            metrics[name].append(masked_mean(values, flat_mask))
        return weighted

    def score_centering(self, batch: PackedBatch, out: Forward, log_probs: torch.Tensor, metrics: dict) -> torch.Tensor:
        """Per-token centring correction ([B, T-1], differentiable) and its diagnostics."""
        rows = batch.head_rows
        if batch.head_valid is None:
            corr, sampler_mass, train_mass = topk_correction(
                out.head_log_probs[rows], batch.head_log_probs[rows], **self.sc_weighting
            )
        else:
            valid = batch.head_valid[rows]
            offsets = torch.zeros(valid.shape[0] + 1, dtype=torch.long)
            torch.cumsum(valid.sum(-1), 0, out=offsets[1:])
            corr, sampler_mass, train_mass = support_correction(
                out.head_log_probs[rows][valid], batch.head_log_probs[rows][valid], offsets, **self.sc_weighting
            )
        correction = torch.zeros_like(log_probs).masked_scatter(rows, corr)
        mask = batch.response_mask
        for name, values in (
            ("sc_correction", correction),
            ("sc_sampler_head_mass", torch.zeros_like(mask).masked_scatter(rows, sampler_mass)),
            ("sc_train_head_mass", torch.zeros_like(mask).masked_scatter(rows, train_mass)),
            (
                "sc_importance_weight",
                sampled_importance_weight(log_probs, batch.rollout_log_probs, **self.sc_weighting),
            ),
        ):
            metrics[name].append(masked_mean(values, mask))
        return correction

    @staticmethod
    def logprob_metrics(batch: PackedBatch, log_probs: torch.Tensor, on_policy: torch.Tensor, metrics: dict) -> None:
        """The gap between the trainer's and the sampler's log-probs of the same tokens (all of them, the
        worst one, and those of the samples generated by the weights being trained)."""
        mask = batch.response_mask
        if batch.rollout_log_probs.abs().sum() > 0:
            diff = (batch.rollout_log_probs - log_probs.detach()).abs() * mask
            metrics["train_rollout_logprob_abs_diff"].append(float(diff.sum()) / float(mask.sum().clamp(min=1)))
            # The worst token (untrained positions are 0 in ``diff``): what bf16 costs shows here first.
            metrics["train_rollout_logprob_abs_diff_max"].append(float(diff.max()))
            on_mask = mask * on_policy
            if on_mask.sum() > 0:
                metrics["onpolicy_logprob_abs_diff"].append(float((diff * on_policy).sum() / on_mask.sum()))

    def value_loss(
        self,
        batch: PackedBatch,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        totals: dict,
        metrics: dict,
    ) -> torch.Tensor:
        """The micro-batch's share of the step's clipped value loss (reduced like the policy loss), from the
        critic's current ``values``."""
        algo = self.algorithm
        mask = batch.response_mask
        per_token, clipped = clipped_value_loss(values, old_values, returns, value_clip=algo.value_clip)
        metrics["value_clipfrac"].append(masked_mean(clipped, mask))
        metrics["value_mean"].append(masked_mean(old_values, mask))
        metrics["return_mean"].append(masked_mean(returns, mask))
        return reduce_loss(per_token, mask, per_token_loss=algo.calculate_per_token_loss, **totals)

    @staticmethod
    def summarize(metrics: dict[str, list[float]]) -> dict[str, float]:
        """One value per metric of the rollout: the maximum of :data:`MAX_METRICS`, the mean of the others."""
        return {k: float(np.max(v) if k in MAX_METRICS else np.mean(v)) for k, v in metrics.items() if v}
