"""PyTorch training backend on a Hugging Face causal LM (CPU or a single device).

Sequences are right-padded into one [batch, tokens] tensor per micro-batch; losses are computed
on response tokens only (shifted by one: the logits at position t predict token t + 1).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import os
import random
import time

import numpy as np
import torch

from vime.config.framework import AlgorithmConfig
from vime.rl.advantages import compute_advantages
from vime.rl.kl import approx_kl
from vime.rl.losses import (
    cispo_loss, gspo_loss, nll_loss, ppo_clip_loss, reduce_loss, reinforce_loss, sequence_log_ratio, token_entropy,
)
from vime.rl.offpolicy import onpolicy_loss_mask
from vime.rl.score_centering import sampled_importance_weight, topk_correction, weighting
from vime.rl.tis import load_tis_function
from vime.sample import Sample


@dataclasses.dataclass(kw_only=True)
class TorchTrainerSpec:
    hf_checkpoint: str
    lr: float
    weight_decay: float
    adam_betas: tuple[float, float]
    adam_eps: float
    clip_grad: float
    micro_batch_size: int
    global_batch_size: int
    n_samples_per_prompt: int
    rollout_temperature: float
    algorithm: AlgorithmConfig
    seed: int
    threads: int | None = None
    cpu_affinity: list[int] | None = None   # CPU cores the trainer may use (None: any)


@dataclasses.dataclass
class PackedBatch:
    input_ids: torch.Tensor        # [B, T]
    attention_mask: torch.Tensor   # [B, T]
    targets: torch.Tensor          # [B, T-1] token predicted at each position
    response_mask: torch.Tensor    # [B, T-1] 1 where the target is a trained response token
    rollout_log_probs: torch.Tensor  # [B, T-1] sampler log-probs at the same places (0 elsewhere)
    starts: list[int] = dataclasses.field(default_factory=list)   # first response position of each row
    lengths: list[int] = dataclasses.field(default_factory=list)  # response length of each row
    head_ids: torch.Tensor | None = None        # [B, T-1, k] sampler top-k token ids (score centering)
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] their sampler log-probs
    head_rows: torch.Tensor | None = None       # [B, T-1] True where a head was recorded

    def rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The response part of each row of a [B, T-1] tensor (ragged, one tensor per sample)."""
        return [values[row, start:start + n] for row, (start, n) in enumerate(zip(self.starts, self.lengths))]

    def unrows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`rows`: place per-sample response values into the [B, T-1] layout (0 elsewhere)."""
        out = torch.zeros(self.targets.shape, dtype=rows[0].dtype if rows else torch.float32)
        for row, (start, values) in enumerate(zip(self.starts, rows)):
            out[row, start:start + values.numel()] = values
        return out


def pack(samples: list[Sample], pad_id: int, loss_masks: list[list[int]] | None = None,
         with_heads: bool = False) -> PackedBatch:
    """Right-pad ``samples`` into one batch. ``loss_masks`` overrides the samples' own masks;
    ``with_heads`` also packs the sampler's top-k heads (score centering)."""
    length = max(len(s.tokens) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1))
    rollout = torch.zeros((batch, length - 1))
    starts, lengths = [], []
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        input_ids[row, :n] = torch.tensor(sample.tokens)
        attention[row, :n] = 1
        start = sample.prompt_length - 1
        if loss_masks is not None:
            mask = loss_masks[row]
        else:
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
        response_mask[row, start:start + sample.response_length] = torch.tensor(mask, dtype=torch.float32)
        if sample.rollout_log_probs is not None:
            rollout[row, start:start + sample.response_length] = torch.tensor(sample.rollout_log_probs)
        starts.append(start)
        lengths.append(sample.response_length)
    packed = PackedBatch(input_ids, attention, input_ids[:, 1:], response_mask, rollout, starts, lengths)
    if with_heads:
        _pack_heads(packed, samples)
    return packed


def _pack_heads(packed: PackedBatch, samples: list[Sample]) -> None:
    heads = []
    for sample in samples:
        ids, log_probs = sample.rollout_topk_token_ids, sample.rollout_topk_log_probs
        if ids is None or log_probs is None:
            if sample.rollout_topp_ids is not None:
                raise NotImplementedError("score centering on a top-p support (--rollout-top-p < 1) is not wired "
                                          "into the torch backend yet; use --rollout-top-p 1")
            raise ValueError(f"score centering needs the sampler's top-k heads: sample {sample.index} of group "
                             f"{sample.group_index} has no rollout_topk_token_ids / rollout_topk_log_probs")
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        log_probs = torch.as_tensor(np.asarray(log_probs), dtype=torch.float32)
        if ids.dim() != 2 or ids.shape != log_probs.shape or ids.shape[0] != sample.response_length:
            raise ValueError(f"sample {sample.index} of group {sample.group_index}: top-k heads of shape "
                             f"{tuple(ids.shape)} / {tuple(log_probs.shape)}, expected [{sample.response_length}, k]")
        heads.append((ids, log_probs))
    k = {ids.shape[1] for ids, _ in heads}
    if len(k) != 1:
        raise ValueError(f"samples of one batch carry top-k heads of different sizes {sorted(k)}")
    shape = (*packed.targets.shape, k.pop())
    packed.head_ids = torch.zeros(shape, dtype=torch.long)
    packed.head_log_probs = torch.zeros(shape)
    packed.head_rows = torch.zeros(packed.targets.shape, dtype=torch.bool)
    for row, ((ids, log_probs), start, n) in enumerate(zip(heads, packed.starts, packed.lengths)):
        packed.head_ids[row, start:start + n] = ids
        packed.head_log_probs[row, start:start + n] = log_probs
        packed.head_rows[row, start:start + n] = True


@dataclasses.dataclass
class Forward:
    log_probs: torch.Tensor                    # [B, T-1] of the target tokens
    entropy: torch.Tensor | None = None        # [B, T-1]
    head_log_probs: torch.Tensor | None = None  # [B, T-1, k] at the sampler's head ids


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values.detach() * mask).sum() / mask.sum().clamp(min=1))


class TorchBackend:
    def __init__(self, spec: TorchTrainerSpec):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per weight publication would drown the progress lines
        self.spec = spec
        algo = spec.algorithm
        if spec.cpu_affinity:
            # Measured on 2 cores: a trainer sharing the engine's core slows both several-fold.
            os.sched_setaffinity(0, spec.cpu_affinity)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self._seed(spec.seed)
        self.model = AutoModelForCausalLM.from_pretrained(spec.hf_checkpoint, dtype=torch.float32)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(spec.hf_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, betas=spec.adam_betas,
                                           eps=spec.adam_eps, weight_decay=spec.weight_decay)
        # The reference model of the KL terms is frozen: it is never trained, saved or checkpointed.
        self.ref_model = None
        if algo.needs_reference_model:
            self.ref_model = AutoModelForCausalLM.from_pretrained(algo.ref_load or spec.hf_checkpoint,
                                                                  dtype=torch.float32)
            self.ref_model.eval().requires_grad_(False)
        self.tis_function = load_tis_function(algo.custom_tis_function_path) if algo.use_tis else None
        # User TIS functions receive ``args`` like the reference framework's; here that is the algorithm's
        # flags plus the few others an importance weight may depend on.
        self.hook_args = argparse.Namespace(**dataclasses.asdict(algo), n_samples_per_prompt=spec.n_samples_per_prompt,
                                            rollout_temperature=spec.rollout_temperature,
                                            hf_checkpoint=spec.hf_checkpoint)
        self.sc_weighting = (weighting(algo.use_tis, algo.custom_tis_function_path, algo.tis_clip_low, algo.tis_clip)
                             if algo.use_score_centering else None)

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ forward
    def _forward(self, model, batch: PackedBatch, *, entropy: str | None = None,
                 heads: bool = False) -> Forward:
        """Log-probs of the targets under ``model`` at the sampling temperature.

        ``entropy``: None, 'metric' (computed without a graph) or 'loss' (differentiable).
        ``heads``: also the log-probs at the sampler's top-k head ids (score centering).
        """
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        if self.spec.rollout_temperature > 0:
            logits = logits / self.spec.rollout_temperature
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        out = Forward(log_softmax.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1))
        if entropy == "loss":
            out.entropy = token_entropy(log_softmax)
        elif entropy == "metric":
            with torch.no_grad():
                out.entropy = token_entropy(log_softmax.detach())
        if heads:
            out.head_log_probs = log_softmax.gather(-1, batch.head_ids)
        return out

    def _log_probs(self, batch: PackedBatch) -> torch.Tensor:
        return self._forward(self.model, batch).log_probs

    def _loss_masks(self, samples: list[Sample], policy_version: int | None) -> list[list[int]]:
        masks = [list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length for s in samples]
        if not self.spec.algorithm.mask_offpolicy_in_partial_rollout:
            return masks
        if policy_version is None:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs the policy version being trained")
        return [onpolicy_loss_mask(mask, s.weight_versions, policy_version) for mask, s in zip(masks, samples)]

    # ------------------------------------------------------------------ one rollout
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """Advantages over the rollout, then one optimizer step per global batch.

        ``policy_version`` (the version of the weights being trained) lets the metrics compare the
        sampler's log-probs with the trainer's on the samples generated entirely by those weights:
        ``onpolicy_logprob_abs_diff`` is ~0 exactly when the engines serve what the trainer holds.
        It is also the version --mask-offpolicy-in-partial-rollout keeps.
        """
        started = time.perf_counter()
        algo = self.spec.algorithm
        size = self.spec.micro_batch_size
        if algo.use_tis or algo.use_rollout_logprobs or algo.use_score_centering:
            missing = next((s for s in samples if s.rollout_log_probs is None), None)
            if missing is not None:
                raise ValueError(f"sample {missing.index} of group {missing.group_index} has no rollout_log_probs, "
                                 "which --use-tis, --use-rollout-logprobs and --use-score-centering need")
        loss_masks = self._loss_masks(samples, policy_version)
        masked_offpolicy = sum(sum(s.loss_mask or [1] * s.response_length) - sum(m)
                               for s, m in zip(samples, loss_masks))
        micro_batches = [samples[i:i + size] for i in range(0, len(samples), size)]
        packed = [pack(mb, self.pad_id, loss_masks[i * size:(i + 1) * size], with_heads=algo.use_score_centering)
                  for i, mb in enumerate(micro_batches)]
        # SFT needs none of these: no old policy, reference or advantages.
        old, ref, advantages = [None] * len(packed), [None] * len(packed), [None] * len(packed)
        if algo.policy_loss != "sft":
            with torch.no_grad():
                self.model.eval()
                old = [b.rollout_log_probs if algo.use_rollout_logprobs else self._log_probs(b) for b in packed]
                self.model.train()
                if self.ref_model is not None:
                    ref = [self._forward(self.ref_model, b).log_probs for b in packed]
            advantages = self._advantages(samples, packed, old, ref)

        metrics: dict[str, list[float]] = collections.defaultdict(list)
        on_policy = [torch.tensor([float(bool(s.weight_versions) and min(s.weight_versions) == policy_version
                                         == max(s.weight_versions)) for s in mb]).unsqueeze(1)
                     for mb in micro_batches]
        per_step = max(1, self.spec.global_batch_size // size)
        for first in range(0, len(packed), per_step):
            steps = range(first, min(first + per_step, len(packed)))
            totals = {"num_samples": sum(packed[i].input_ids.shape[0] for i in steps),
                      "num_tokens": float(sum(packed[i].response_mask.sum() for i in steps))}
            self.optimizer.zero_grad(set_to_none=True)
            # Loss terms are each micro-batch's share of the step's value: they add up over the step.
            step_terms: dict[str, float] = collections.defaultdict(float)
            for i in steps:
                loss, log_probs = self._micro_batch_loss(packed[i], old[i], ref[i], advantages[i], totals,
                                                         step_terms, metrics)
                loss.backward()
                step_terms["loss"] += float(loss.detach())
                self._logprob_metrics(packed[i], log_probs, on_policy[i], metrics)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.spec.clip_grad if self.spec.clip_grad > 0 else math.inf)
            self.optimizer.step()
            for name, value in step_terms.items():
                metrics[name].append(value)
            metrics["grad_norm"].append(float(grad_norm))
        elapsed = time.perf_counter() - started
        result = {k: float(np.mean(v)) for k, v in metrics.items() if v}
        result["train_tokens"] = float(sum(len(s.tokens) for s in samples))
        result["train_seconds"] = elapsed
        result["optimizer_steps"] = float(math.ceil(len(packed) / per_step))
        if algo.mask_offpolicy_in_partial_rollout:
            result["offpolicy_masked_tokens"] = float(masked_offpolicy)
        return result

    def _advantages(self, samples: list[Sample], packed: list[PackedBatch], old: list[torch.Tensor],
                    ref: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Token advantages of the whole rollout (whitening and group baselines span micro-batches),
        returned in each micro-batch's [B, T-1] layout."""
        algo = self.spec.algorithm
        if any(s.reward is None for s in samples):
            missing = next(s for s in samples if s.reward is None)
            raise ValueError(f"sample {missing.index} of group {missing.group_index} has no reward")
        masks = [row for b in packed for row in b.rows(b.response_mask)]
        kl = None
        if algo.kl_coef:
            # Reward shaping compares the policy that generated the batch (old log-probs) with the reference.
            kl = [row for b, o, r in zip(packed, old, ref) for row in b.rows(approx_kl(o, r, algo.kl_loss_type))]
        token_advantages = compute_advantages(
            algo.advantage_estimator, torch.tensor([float(s.reward) for s in samples]), masks,
            group_size=self.spec.n_samples_per_prompt, kl=kl, kl_coef=algo.kl_coef, gamma=algo.gamma,
            lambd=algo.lambd, normalize_std=not algo.disable_grpo_std_normalization,
            normalize=algo.normalize_advantages)
        out, first = [], 0
        for b in packed:
            out.append(b.unrows(token_advantages[first:first + len(b.starts)]))
            first += len(b.starts)
        return out

    def _micro_batch_loss(self, batch: PackedBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                          advantages: torch.Tensor | None, totals: dict, step_terms: dict,
                          metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the step loss (micro-batch losses add up to the step's), and its log-probs.

        Loss terms are added to ``step_terms`` (shares of the step's value), token averages to ``metrics``.
        """
        algo = self.spec.algorithm
        mask = batch.response_mask
        reduce = functools.partial(reduce_loss, per_token_loss=algo.calculate_per_token_loss, **totals)
        kind = algo.policy_loss
        out = self._forward(self.model, batch, entropy="loss" if algo.entropy_coef else "metric",
                            heads=algo.use_score_centering)
        log_probs = out.log_probs
        if kind == "sft":
            loss = reduce(nll_loss(log_probs), mask)
            metrics["entropy"].append(_masked_mean(out.entropy, mask))
            return loss, log_probs

        if kind == "gspo":
            per_token, clipped = gspo_loss(log_probs, old, advantages, mask, eps_clip=algo.eps_clip,
                                           eps_clip_high=algo.eps_clip_high)
            ppo_kl = -sequence_log_ratio(log_probs.detach(), old, mask).expand_as(log_probs)
        else:
            if kind == "ppo":
                per_token, clipped = ppo_clip_loss(log_probs, old, advantages, eps_clip=algo.eps_clip,
                                                   eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c)
            elif kind == "cispo":
                per_token, clipped = cispo_loss(log_probs, old, advantages, eps_clip=algo.eps_clip,
                                                eps_clip_high=algo.eps_clip_high)
            else:
                per_token, clipped = reinforce_loss(log_probs, advantages), torch.zeros_like(log_probs)
            ppo_kl = old - log_probs.detach()
        if self.tis_function is not None:
            # REINFORCE has no old policy in its objective: its weight compares the current trainer (detached).
            trainer = log_probs.detach() if kind == "reinforce" else old
            per_token = self._apply_tis(batch, per_token, trainer, metrics)
        if algo.use_score_centering:
            per_token = per_token + advantages.detach() * self._score_centering(batch, out, log_probs, metrics)

        pg_loss = reduce(per_token, mask)
        entropy_loss = reduce(out.entropy, mask)
        loss = pg_loss - algo.entropy_coef * entropy_loss if algo.entropy_coef else pg_loss
        if ref is not None:
            kl = approx_kl(log_probs if algo.use_kl_loss else log_probs.detach(), ref, algo.kl_loss_type)
            if algo.use_kl_loss:
                kl_loss = reduce(kl, mask)
                step_terms["kl_loss"] += float(kl_loss.detach())
                if algo.kl_loss_coef:
                    loss = loss + algo.kl_loss_coef * kl_loss
            metrics["kl"].append(_masked_mean(kl, mask))
        step_terms["pg_loss"] += float(pg_loss.detach())
        metrics["entropy"].append(_masked_mean(out.entropy, mask))
        metrics["pg_clipfrac"].append(_masked_mean(clipped, mask))
        metrics["ppo_kl"].append(_masked_mean(ppo_kl, mask))
        return loss, log_probs

    def _apply_tis(self, batch: PackedBatch, per_token: torch.Tensor, trainer_log_probs: torch.Tensor,
                   metrics: dict) -> torch.Tensor:
        """Weight the per-token loss with the TIS function; tokens it rejects leave the numerator only."""
        masks = batch.rows(batch.response_mask)
        pg_loss, new_masks, tis_metrics = self.tis_function(
            self.hook_args, pg_loss=torch.cat(batch.rows(per_token)), train_log_probs=batch.rows(trainer_log_probs),
            rollout_log_probs=batch.rows(batch.rollout_log_probs), loss_masks=masks,
            total_lengths=[start + 1 + n for start, n in zip(batch.starts, batch.lengths)],
            response_lengths=list(batch.lengths))
        weighted = batch.unrows(list(pg_loss.split(batch.lengths)))
        if new_masks is not masks:
            weighted = weighted * batch.unrows([m.to(weighted.dtype) for m in new_masks])
        flat_mask = torch.cat(masks)
        for name, values in tis_metrics.items():
            metrics[name].append(_masked_mean(values, flat_mask))
        return weighted

    def _score_centering(self, batch: PackedBatch, out: Forward, log_probs: torch.Tensor,
                         metrics: dict) -> torch.Tensor:
        """Per-token centring correction ([B, T-1], differentiable) and its diagnostics."""
        rows = batch.head_rows
        corr, sampler_mass, train_mass = topk_correction(out.head_log_probs[rows], batch.head_log_probs[rows],
                                                         **self.sc_weighting)
        correction = torch.zeros_like(log_probs).masked_scatter(rows, corr)
        mask = batch.response_mask
        for name, values in (("sc_correction", correction),
                             ("sc_sampler_head_mass", torch.zeros_like(mask).masked_scatter(rows, sampler_mass)),
                             ("sc_train_head_mass", torch.zeros_like(mask).masked_scatter(rows, train_mass)),
                             ("sc_importance_weight", sampled_importance_weight(
                                 log_probs, batch.rollout_log_probs, **self.sc_weighting))):
            metrics[name].append(_masked_mean(values, mask))
        return correction

    def _logprob_metrics(self, batch: PackedBatch, log_probs: torch.Tensor, on_policy: torch.Tensor,
                         metrics: dict) -> None:
        mask = batch.response_mask
        if batch.rollout_log_probs.abs().sum() > 0:
            diff = (batch.rollout_log_probs - log_probs.detach()).abs() * mask
            metrics["train_rollout_logprob_abs_diff"].append(float(diff.sum()) / float(mask.sum().clamp(min=1)))
            on_mask = mask * on_policy
            if on_mask.sum() > 0:
                metrics["onpolicy_logprob_abs_diff"].append(float((diff * on_policy).sum() / on_mask.sum()))

    # ------------------------------------------------------------------ weights and checkpoints
    def save_hf(self, path: str) -> None:
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)

    def save_weights(self, path: str) -> None:
        """The inference weights only (what an engine reloads)."""
        self.model.save_pretrained(path, safe_serialization=True)

    def save_training_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state()}},
                   os.path.join(path, "optimizer_and_rng.pt"))

    def load_training_state(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"), dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        state = torch.load(os.path.join(path, "optimizer_and_rng.pt"), weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
