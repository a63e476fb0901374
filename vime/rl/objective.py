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
import dataclasses
import functools

import numpy as np
import torch

from vime.config.algorithm import AlgorithmConfig
from vime.config.hooks import HooksConfig
from vime.errors import UserError
from vime.rl.advantages import compute_advantages, grpo_advantages, ppo_advantages_and_returns, whiten_ragged
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
from vime.runtime.plugins import load_hook
from vime.sample import Sample

POST_PROCESS_FLAG = "--custom-reward-post-process-path"
CUSTOM_LOSS_FLAG = "--custom-loss-function-path"
ADVANTAGE_FLAG = "--custom-advantage-function-path"
REDUCER_FLAG = "--custom-pg-loss-reducer-function-path"
CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"


class RewardPostProcessError(UserError, ValueError):
    """--custom-reward-post-process-path returned something other than (raw_rewards, rewards) of the samples."""


class CustomHookError(UserError, ValueError):
    """A custom loss, advantage, reducer or conversion function returned something vime cannot train on; the
    message names the flag and the path."""


def _load(flag: str, path: str | None):
    """The hook of ``flag`` (its call checked, vime.runtime.plugins), None without a path."""
    return load_hook(flag, path) if path else None


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
        self.reward_post_process = (
            load_hook(POST_PROCESS_FLAG, algo.custom_reward_post_process_path)
            if algo.custom_reward_post_process_path
            else None
        )
        self.hooks = hooks or HooksConfig()
        self.custom_loss = _load(
            CUSTOM_LOSS_FLAG, algo.custom_loss_function_path if algo.loss_type == "custom_loss" else None
        )
        self.advantage_function = _load(ADVANTAGE_FLAG, algo.custom_advantage_function_path)
        self.pg_loss_reducer = _load(REDUCER_FLAG, algo.custom_pg_loss_reducer_function_path)
        self.convert_samples = _load(CONVERT_FLAG, self.hooks.custom_convert_samples_to_train_data_path)
        self.hook_args = argparse.Namespace(
            **{
                **(custom_config or {}),
                **dataclasses.asdict(algo),
                **dataclasses.asdict(self.hooks),
                # The reference framework's names of the --disable-* flags.
                "compute_advantages_and_returns": not algo.disable_compute_advantages_and_returns,
                "rewards_normalization": not algo.disable_rewards_normalization,
                "n_samples_per_prompt": n_samples_per_prompt,
                "rollout_temperature": rollout_temperature,
                "hf_checkpoint": hf_checkpoint,
            }
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
        """The samples the trainer trains on: ``samples``, or what --custom-convert-samples-to-train-data-path
        makes of them (its tokens, response lengths, loss masks, rewards and, if given, rollout log-probs, one
        entry per sample; the rewards are then used as they are, without group normalisation)."""
        if self.convert_samples is None:
            return samples
        path = self.hooks.custom_convert_samples_to_train_data_path
        where = f"{CONVERT_FLAG} {path}"
        data = self.convert_samples(self.hook_args, samples)
        if not isinstance(data, dict):
            raise CustomHookError(f"{where}: returned {type(data).__name__}; expected a dict of per-sample lists")
        required = ("tokens", "response_lengths", "rewards", "loss_masks")
        missing = [key for key in required if key not in data]
        if missing:
            raise CustomHookError(f"{where}: the dict has no {', '.join(missing)} (it has {', '.join(sorted(data))})")
        optional = [key for key in ("rollout_log_probs",) if data.get(key) is not None]
        for key in (*required, *optional):
            if len(data[key]) != len(samples):
                raise CustomHookError(
                    f"{where}: {key} has {len(data[key])} entries for {len(samples)} samples (vime trains the "
                    "samples it converts, one entry each)"
                )
        out = []
        for i, sample in enumerate(samples):
            tokens = [int(t) for t in data["tokens"][i]]
            n = int(data["response_lengths"][i])
            mask = [int(m) for m in data["loss_masks"][i]]
            if not 0 < n < len(tokens) or len(mask) != n:
                raise CustomHookError(
                    f"{where}: sample {i}: {len(tokens)} tokens, response length {n}, {len(mask)} loss-mask "
                    "entries; the response must be 1 to len(tokens) - 1 tokens, with one mask entry each"
                )
            if optional:
                rollout_log_probs = [float(x) for x in data["rollout_log_probs"][i]]
            elif sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == n:
                rollout_log_probs = sample.rollout_log_probs
            else:
                rollout_log_probs = None
            out.append(
                dataclasses.replace(
                    sample,
                    tokens=tokens,
                    response_length=n,
                    loss_mask=mask,
                    reward=float(data["rewards"][i]),
                    rollout_log_probs=rollout_log_probs,
                )
            )
        return out

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
        group_baseline = self.convert_samples is None and not algo.disable_rewards_normalization
        if self.reward_post_process is not None:
            rewards, group_baseline = self.post_processed_rewards(samples), False
        token_returns = None
        if self.advantage_function is not None:
            token_advantages, token_returns = self.custom_advantages(
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

    def custom_advantages(self, samples, packed, old, ref, values, masks, kl, rewards, group_baseline):
        """--custom-advantage-function-path: ``custom_fn(args, rollout_data)`` sets ``rollout_data['advantages']``
        and ``['returns']`` (one tensor per sample over its response tokens), as the reference framework's.
        ``rollout_data`` holds per-sample lists: rewards (group-normalised as the estimator would), raw_reward,
        kl (0 without --kl-coef), log_probs (old policy), ref_log_probs, values (PPO's critic), rollout_log_probs,
        loss_masks, response_lengths, total_lengths."""
        algo = self.algorithm
        where = f"{ADVANTAGE_FLAG} {algo.custom_advantage_function_path}"

        def rows(values_per_batch):
            if any(v is None for v in values_per_batch):
                return None
            return [row for b, v in zip(packed, values_per_batch) for row in b.rows(v)]

        normalized = rewards
        if group_baseline and algo.advantage_estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"):
            std = algo.advantage_estimator != "reinforce_plus_plus_baseline" and not algo.disable_grpo_std_normalization
            normalized = grpo_advantages(rewards, self.n_samples_per_prompt, normalize_std=std)
        rollout_data = {
            "rewards": [float(r) for r in normalized],
            "raw_reward": [float(s.reward) for s in samples],
            "kl": kl if kl is not None else [torch.zeros_like(m) for m in masks],
            "log_probs": rows(old),
            "ref_log_probs": rows(ref),
            "values": rows(values),
            "rollout_log_probs": [row for b in packed for row in b.rows(b.rollout_log_probs)],
            "loss_masks": masks,
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [len(s.tokens) for s in samples],
        }
        self.advantage_function(self.hook_args, rollout_data)
        out = []
        for key in ("advantages", "returns"):
            values_ = rollout_data.get(key)
            if values_ is None and key == "returns" and not algo.uses_critic:
                out.append(None)  # only PPO's critic reads the returns
                continue
            if values_ is None or len(values_) != len(samples):
                got = "nothing" if values_ is None else f"{len(values_)} entries"
                raise CustomHookError(
                    f"{where}: rollout_data[{key!r}] holds {got}; expected one tensor per sample ({len(samples)})"
                )
            tensors = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values_]
            for i, (tensor, sample) in enumerate(zip(tensors, samples)):
                if tensor.numel() != sample.response_length:
                    raise CustomHookError(
                        f"{where}: rollout_data[{key!r}][{i}] has {tensor.numel()} values for "
                        f"{sample.response_length} response tokens"
                    )
            out.append(tensors)
        advantages = [a * m.to(a.dtype) for a, m in zip(out[0], masks)]
        return advantages, out[1]

    def post_processed_rewards(self, samples: list[Sample]) -> torch.Tensor:
        """The rewards --custom-reward-post-process-path makes of the rollout's: its ``(raw_rewards,
        rewards)``, one entry per sample each; ``rewards`` feed the advantages."""
        path = self.algorithm.custom_reward_post_process_path
        result = self.reward_post_process(self.hook_args, samples)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise RewardPostProcessError(
                f"{POST_PROCESS_FLAG} {path}: returned {type(result).__name__}; expected (raw_rewards, rewards)"
            )
        for name, values in zip(("raw_rewards", "rewards"), result):
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise RewardPostProcessError(
                    f"{POST_PROCESS_FLAG} {path}: {name} is a {type(values).__name__}; expected (raw_rewards, "
                    "rewards), a list of one value per sample each"
                )
            if len(values) != len(samples):
                raise RewardPostProcessError(
                    f"{POST_PROCESS_FLAG} {path}: {name} has {len(values)} entries for {len(samples)} samples"
                )
        return torch.tensor([float(value) for value in result[1]])

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
            return self.custom_policy_loss(batch, out, old, ref, advantages, totals, metrics), log_probs

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

        if self.pg_loss_reducer is not None:
            pg_loss = self.custom_pg_loss(batch, per_token, totals)
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

    # ------------------------------------------------------------------ the reference framework's reductions
    def sum_of_sample_mean(self, batch: PackedBatch):
        """The reference framework's reducer of a micro-batch's per-token values (concatenated over its samples'
        response tokens): the sum over samples of each one's mean over its loss-masked tokens, or with
        --calculate-per-token-loss the sum over all of them. vime divides what a loss built with it returns
        by :meth:`step_denominator`, as the reference's scaling does."""
        masks = batch.rows(batch.response_mask)
        per_token = self.algorithm.calculate_per_token_loss

        def reducer(values: torch.Tensor) -> torch.Tensor:
            parts = values.reshape(-1).split(list(batch.lengths))
            if per_token:
                terms = [(p * m.to(p.dtype)).sum() for p, m in zip(parts, masks)]
            else:
                terms = [(p * m.to(p.dtype)).sum() / m.sum().clamp(min=1) for p, m in zip(parts, masks)]
            return torch.stack(terms).sum() if terms else values.sum() * 0

        return reducer

    def step_denominator(self, batch: PackedBatch, totals: dict) -> float:
        """What a sum-of-sample-means is divided by to be the micro-batch's share of the step loss (as
        :func:`vime.rl.losses.reduce_loss`): the step's samples, or with --calculate-per-token-loss its tokens."""
        if self.algorithm.calculate_per_token_loss:
            tokens = totals.get("num_tokens")
            return max(float(batch.response_mask.sum()) if tokens is None else tokens, 1.0)
        return float(totals.get("num_samples") or batch.input_ids.shape[0])

    def custom_pg_loss(self, batch: PackedBatch, per_token: torch.Tensor, totals: dict) -> torch.Tensor:
        """--custom-pg-loss-reducer-function-path: pg_loss reduced by the user's reducer, built per micro-batch
        as get_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)."""
        algo = self.algorithm
        where = f"{REDUCER_FLAG} {algo.custom_pg_loss_reducer_function_path}"
        reducer = self.pg_loss_reducer(
            [start + 1 + n for start, n in zip(batch.starts, batch.lengths)],
            list(batch.lengths),
            batch.rows(batch.response_mask),
            algo.calculate_per_token_loss,
        )
        if not callable(reducer):
            raise CustomHookError(f"{where}: returned {type(reducer).__name__}; expected a reducer(pg_loss) function")
        value = reducer(torch.cat(batch.rows(per_token)))
        if not torch.is_tensor(value) or value.numel() != 1:
            raise CustomHookError(f"{where}: its reducer returned {type(value).__name__}; expected a scalar tensor")
        return value.reshape(()) / self.step_denominator(batch, totals)

    def custom_policy_loss(
        self,
        batch: PackedBatch,
        out: Forward,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        advantages: torch.Tensor | None,
        totals: dict,
        metrics: dict,
    ) -> torch.Tensor:
        """--loss-type custom_loss: ``loss_fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``.

        ``batch`` holds per-sample lists over the response tokens, under the reference framework's keys:
        tokens (the whole sequence), total_lengths, response_lengths, loss_masks, log_probs (old policy),
        advantages (unless --disable-compute-advantages-and-returns), ref_log_probs (with a KL term),
        rollout_log_probs; and vime's cur_log_probs (the current policy's, with gradient) and entropy. vime's
        backends never materialise the logits (chunked, vocabulary-parallel), so ``logits`` is the training
        forward (vime.rl.batch.Forward: ``log_probs`` and ``entropy``, [B, T-1], temperature-scaled)."""
        algo = self.algorithm
        where = f"{CUSTOM_LOSS_FLAG} {algo.custom_loss_function_path}"
        rows = batch.rows
        data = {
            "tokens": [
                batch.input_ids[row, : start + 1 + n] for row, (start, n) in enumerate(zip(batch.starts, batch.lengths))
            ],
            "total_lengths": [start + 1 + n for start, n in zip(batch.starts, batch.lengths)],
            "response_lengths": list(batch.lengths),
            "loss_masks": rows(batch.response_mask),
            "rollout_log_probs": rows(batch.rollout_log_probs),
            "cur_log_probs": rows(out.log_probs),
        }
        for key, values in (
            ("log_probs", old),
            ("ref_log_probs", ref),
            ("advantages", advantages),
            ("entropy", out.entropy),
        ):
            if values is not None:
                data[key] = rows(values)
        result = self.custom_loss(self.hook_args, data, out, self.sum_of_sample_mean(batch))
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise CustomHookError(f"{where}: returned {type(result).__name__}; expected (loss, metrics)")
        loss, log = result
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise CustomHookError(f"{where}: its loss is a {type(loss).__name__}; expected a scalar tensor")
        if log is not None and not isinstance(log, dict):
            raise CustomHookError(f"{where}: its metrics are a {type(log).__name__}; expected a dict")
        # Its metrics are sums of sample means too: per sample (per token) of this micro-batch.
        local = float(batch.response_mask.sum()) if algo.calculate_per_token_loss else batch.input_ids.shape[0]
        for name, value in (log or {}).items():
            metrics[name].append(float(value.detach() if torch.is_tensor(value) else value) / max(local, 1))
        return loss.reshape(()) / self.step_denominator(batch, totals)

    def apply_tis(
        self, batch: PackedBatch, per_token: torch.Tensor, trainer_log_probs: torch.Tensor, metrics: dict
    ) -> torch.Tensor:
        """Weight the per-token loss with the TIS function; tokens it rejects leave the numerator only."""
        masks = batch.rows(batch.response_mask)
        pg_loss, new_masks, tis_metrics = self.tis_function(
            self.hook_args,
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
