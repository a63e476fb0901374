"""Objective-level hooks written as the reference framework's (its signatures), for the tests that train
with them on both backends (tests/unit/test_megatron_backend.py, tests/unit/test_custom_hooks_training.py)."""

from __future__ import annotations

import torch


def reinforce_loss(args, batch, logits, sum_of_sample_mean):
    """--loss-type custom_loss: REINFORCE (-A log p) plus the KL loss, reduced with sum_of_sample_mean."""
    log_probs = torch.cat(batch["cur_log_probs"])
    advantages = torch.cat(batch["advantages"])
    loss = sum_of_sample_mean(-advantages * log_probs)
    if "ref_log_probs" in batch:
        loss = loss + args.kl_loss_coef * sum_of_sample_mean(log_probs - torch.cat(batch["ref_log_probs"]))
    return loss, {"custom_pg_loss": loss.detach()}


def constant_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """--custom-pg-loss-reducer-function-path: Dr. GRPO's constant normaliser (each sample's sum over 8)."""

    def reduce(values):
        return sum((part * mask).sum() / 8.0 for part, mask in zip(values.split(response_lengths), loss_masks))

    return reduce


def scaled_advantages(args, rollout_data):
    """--custom-advantage-function-path: each sample's reward x 0.5 on its trained tokens."""
    rollout_data["advantages"] = [
        0.5 * reward * mask.float() for reward, mask in zip(rollout_data["rewards"], rollout_data["loss_masks"])
    ]
    rollout_data["returns"] = rollout_data["advantages"]


def convert_samples(args, samples):
    """--custom-convert-samples-to-train-data-path: the default conversion, with the rewards negated."""
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [-s.reward for s in samples],
        "loss_masks": [s.loss_mask for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
    }
