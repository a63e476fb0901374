"""PyTorch training backend on a Hugging Face causal LM (CPU or a single device).

Sequences are right-padded into one [batch, tokens] tensor per micro-batch; losses are computed
on response tokens only (shifted by one: the logits at position t predict token t + 1).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time

import numpy as np
import torch

from vime.config.framework import AlgorithmConfig
from vime.rl.advantages import grpo_advantages, whiten
from vime.rl.losses import ppo_clip_loss, reduce_loss
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


def pack(samples: list[Sample], pad_id: int) -> PackedBatch:
    length = max(len(s.tokens) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1))
    rollout = torch.zeros((batch, length - 1))
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        input_ids[row, :n] = torch.tensor(sample.tokens)
        attention[row, :n] = 1
        start = sample.prompt_length - 1
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
        response_mask[row, start:start + sample.response_length] = torch.tensor(mask, dtype=torch.float32)
        if sample.rollout_log_probs is not None:
            rollout[row, start:start + sample.response_length] = torch.tensor(sample.rollout_log_probs)
    return PackedBatch(input_ids, attention, input_ids[:, 1:], response_mask, rollout)


class TorchBackend:
    def __init__(self, spec: TorchTrainerSpec):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per weight publication would drown the progress lines
        self.spec = spec
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

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ forward
    def _log_probs(self, batch: PackedBatch) -> torch.Tensor:
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        if self.spec.rollout_temperature > 0:
            logits = logits / self.spec.rollout_temperature
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    # ------------------------------------------------------------------ one rollout
    def train_rollout(self, samples: list[Sample], policy_version: int | None = None) -> dict[str, float]:
        """Advantages over the rollout, then one optimizer step per global batch.

        ``policy_version`` (the version of the weights being trained) lets the metrics compare the
        sampler's log-probs with the trainer's on the samples generated entirely by those weights:
        ``onpolicy_logprob_abs_diff`` is ~0 exactly when the engines serve what the trainer holds.
        """
        started = time.perf_counter()
        algo = self.spec.algorithm
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = grpo_advantages(rewards, self.spec.n_samples_per_prompt,
                                     normalize_std=not algo.disable_grpo_std_normalization)
        micro_batches = [samples[i:i + self.spec.micro_batch_size]
                         for i in range(0, len(samples), self.spec.micro_batch_size)]
        packed = [pack(mb, self.pad_id) for mb in micro_batches]
        sample_adv = [advantages[i:i + self.spec.micro_batch_size]
                      for i in range(0, len(samples), self.spec.micro_batch_size)]
        with torch.no_grad():
            self.model.eval()
            old = [b.rollout_log_probs if algo.use_rollout_logprobs else self._log_probs(b) for b in packed]
            self.model.train()
        token_adv = [adv.unsqueeze(1) * b.response_mask for adv, b in zip(sample_adv, packed)]
        if algo.normalize_advantages:
            flat = torch.cat([a.flatten() for a in token_adv])
            mask = torch.cat([b.response_mask.flatten() for b in packed])
            whitened = whiten(flat, mask).split([a.numel() for a in token_adv])
            token_adv = [w.view_as(a) for w, a in zip(whitened, token_adv)]

        metrics: dict[str, list[float]] = {k: [] for k in ("loss", "pg_clipfrac", "ppo_kl", "grad_norm",
                                                           "train_rollout_logprob_abs_diff",
                                                           "onpolicy_logprob_abs_diff")}
        on_policy = [torch.tensor([float(bool(s.weight_versions) and min(s.weight_versions) == policy_version
                                         == max(s.weight_versions)) for s in mb]).unsqueeze(1)
                     for mb in micro_batches]
        per_step = max(1, self.spec.global_batch_size // self.spec.micro_batch_size)
        for first in range(0, len(packed), per_step):
            steps = range(first, min(first + per_step, len(packed)))
            num_samples = sum(packed[i].input_ids.shape[0] for i in steps)
            num_tokens = float(sum(packed[i].response_mask.sum() for i in steps))
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for i in steps:
                batch = packed[i]
                log_probs = self._log_probs(batch)
                per_token, clipped = ppo_clip_loss(log_probs, old[i], token_adv[i], eps_clip=algo.eps_clip,
                                                   eps_clip_high=algo.eps_clip_high)
                loss = reduce_loss(per_token, batch.response_mask, per_token_loss=algo.calculate_per_token_loss,
                                   num_samples=num_samples, num_tokens=num_tokens)
                loss.backward()
                step_loss += float(loss)
                mask = batch.response_mask
                denominator = float(mask.sum().clamp(min=1))
                metrics["pg_clipfrac"].append(float((clipped * mask).sum()) / denominator)
                metrics["ppo_kl"].append(float(((old[i] - log_probs.detach()) * mask).sum()) / denominator)
                if batch.rollout_log_probs.abs().sum() > 0:
                    diff = (batch.rollout_log_probs - log_probs.detach()).abs() * mask
                    metrics["train_rollout_logprob_abs_diff"].append(float(diff.sum()) / denominator)
                    on_mask = mask * on_policy[i]
                    if on_mask.sum() > 0:
                        metrics["onpolicy_logprob_abs_diff"].append(float((diff * on_policy[i]).sum() / on_mask.sum()))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.spec.clip_grad if self.spec.clip_grad > 0 else math.inf)
            self.optimizer.step()
            metrics["loss"].append(step_loss)
            metrics["grad_norm"].append(float(grad_norm))
        elapsed = time.perf_counter() - started
        result = {k: float(np.mean(v)) for k, v in metrics.items() if v}
        result["train_tokens"] = float(sum(len(s.tokens) for s in samples))
        result["train_seconds"] = elapsed
        result["optimizer_steps"] = float(math.ceil(len(packed) / per_step))
        return result

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
