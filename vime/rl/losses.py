"""Policy losses and their reductions (pure functions, shared by every training backend).

Tensors are [batch, response_len] padded to the longest response; ``mask`` is 1 on tokens that
count (loss mask of the sample and inside its response).
"""

from __future__ import annotations

import torch


def ppo_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  *, eps_clip: float, eps_clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: -min(r A, clip(r, 1-eps, 1+eps_high) A), r = exp(logp - logp_old).

    Returns (per-token loss, per-token indicator that the clip was active).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(log_probs.dtype)


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, *, per_token_loss: bool,
                num_samples: int | None = None, num_tokens: float | None = None) -> torch.Tensor:
    """Per-sample default: mean_i(sum(sample_i) / len(sample_i)); per-token: sum / total tokens.

    When a batch is split into micro-batches, pass the whole batch's ``num_samples`` (per-sample)
    or ``num_tokens`` (per-token) so that the micro-batch losses add up to the batch loss.
    """
    mask = mask.to(per_token.dtype)
    if per_token_loss:
        denominator = mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
        return (per_token * mask).sum() / denominator
    lengths = mask.sum(dim=1).clamp(min=1)
    return ((per_token * mask).sum(dim=1) / lengths).sum() / (num_samples or per_token.shape[0])
