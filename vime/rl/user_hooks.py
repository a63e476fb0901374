"""The reference framework's user hooks of the RL objective, and what vime makes of what they return.

--custom-convert-samples-to-train-data-path, --custom-reward-post-process-path,
--custom-advantage-function-path, --custom-pg-loss-reducer-function-path and --loss-type custom_loss with
--custom-loss-function-path: each is loaded (its call checked) once, called with the reference's signature
and ``args`` (:attr:`UserHooks.args`), and what it returns is checked before anything trains on it, with
errors that name the flag and the path. :class:`vime.rl.objective.RLObjective` calls them where the
built-in computation would run.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from vime.config.algorithm import AlgorithmConfig
from vime.config.hooks import HooksConfig
from vime.errors import UserError
from vime.rl.advantages import grpo_advantages
from vime.rl.batch import Forward, PackedBatch
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


class UserHooks:
    """The hooks ``algorithm`` and ``hooks`` name (each None when not given), and ``args``: what every user
    function receives, as the reference framework's ``args`` — the algorithm's flags, the ``hooks`` flags
    (vime.config.hooks), ``n_samples_per_prompt``, ``rollout_temperature``, ``hf_checkpoint`` and the keys of
    --custom-config-path (``custom_config``)."""

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
        algo = self.algorithm = algorithm
        self.n_samples_per_prompt = n_samples_per_prompt
        self.hooks = hooks or HooksConfig()
        self.reward_post_process = _load(POST_PROCESS_FLAG, algo.custom_reward_post_process_path)
        self.custom_loss = _load(
            CUSTOM_LOSS_FLAG, algo.custom_loss_function_path if algo.loss_type == "custom_loss" else None
        )
        self.advantage_function = _load(ADVANTAGE_FLAG, algo.custom_advantage_function_path)
        self.pg_loss_reducer = _load(REDUCER_FLAG, algo.custom_pg_loss_reducer_function_path)
        self.convert_samples = _load(CONVERT_FLAG, self.hooks.custom_convert_samples_to_train_data_path)
        self.args = argparse.Namespace(
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

    def train_samples(self, samples: list[Sample]) -> list[Sample]:
        """The samples the trainer trains on: ``samples``, or what --custom-convert-samples-to-train-data-path
        makes of them (its tokens, response lengths, loss masks, rewards and, if given, rollout log-probs, one
        entry per sample; the rewards are then used as they are, without group normalisation)."""
        if self.convert_samples is None:
            return samples
        path = self.hooks.custom_convert_samples_to_train_data_path
        where = f"{CONVERT_FLAG} {path}"
        data = self.convert_samples(self.args, samples)
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

    def advantages(self, samples, packed, old, ref, values, masks, kl, rewards, group_baseline):
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
        self.advantage_function(self.args, rollout_data)
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
        result = self.reward_post_process(self.args, samples)
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

    def pg_loss(self, batch: PackedBatch, per_token: torch.Tensor, totals: dict) -> torch.Tensor:
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

    def policy_loss(
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
        result = self.custom_loss(self.args, data, out, self.sum_of_sample_mean(batch))
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
