"""Policy losses and their reductions (pure functions, shared by every training backend).

Tensors are [batch, response_len] padded to the longest response; ``mask`` is 1 on tokens that
count (loss mask of the sample and inside its response). Each loss returns per-token values; the
reduction to one number is :func:`reduce_loss`. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: -min(r A, clip(r, 1-eps, 1+eps_high) A), r = exp(logp - logp_old).

    With ``eps_clip_c`` (dual-clip PPO) the loss of a negative-advantage token is also capped at -c A,
    so that a huge ratio cannot produce a huge update. Returns (per-token loss, per-token indicator
    that the clip was active).
    """
    return clipped_ratio_loss(
        torch.exp(log_probs - old_log_probs),
        advantages,
        eps_clip=eps_clip,
        eps_clip_high=eps_clip_high,
        eps_clip_c=eps_clip_c,
    )


def clipped_ratio_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO surrogate for any importance ratio (per token for PPO, per sequence for GSPO)."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, (clipped < unclipped).to(ratio.dtype)


def sequence_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised log importance ratio of each sequence: mean over its masked tokens of
    (logp - logp_old). Shape [batch, 1]; the gradient flows through every token's log-prob."""
    mask = mask.to(log_probs.dtype)
    return ((log_probs - old_log_probs) * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (arXiv:2507.18071): the clipped surrogate on the sequence ratio s_i = exp(sequence_log_ratio),
    the same value on each token of the sequence (so a per-sample mean gives the sequence's loss).

    ``advantages`` are per token but constant within a sequence (GRPO's group-normalised reward).
    Returns (per-token loss, per-token clip indicator), both [batch, response_len].
    """
    ratio = torch.exp(sequence_log_ratio(log_probs, old_log_probs, mask)).expand_as(log_probs)
    return clipped_ratio_loss(ratio, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(r, 1-eps, 1+eps_high)) A log p.

    The clipped ratio is a constant weight, so a clipped token still contributes the REINFORCE gradient
    (PPO would drop it). The paper leaves the lower bound open: use --eps-clip 1 for that.
    Returns (per-token loss, per-token indicator that the ratio was clipped).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs).detach()
    weight = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    return -weight * advantages * log_probs, (weight != ratio).to(log_probs.dtype)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's critic loss per token: max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), c = --value-clip.

    The clipped term keeps one update from moving a value far from the one the advantages were computed
    with (as in the reference framework; no factor 1/2). Returns (per-token loss, per-token indicator that
    |V - V_old| > c).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    loss = torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return loss, ((values - old_values).abs() > value_clip).to(values.dtype)


def reinforce_loss(log_probs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Vanilla policy gradient: -A log p (the advantage is a constant)."""
    return -advantages.detach() * log_probs


def nll_loss(log_probs: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning (--loss-type sft_loss): the negative log-likelihood of each token."""
    return -log_probs


def token_entropy(log_softmax: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of each position's distribution, from log-probs over the vocabulary [..., V]."""
    return -(log_softmax.exp() * log_softmax).sum(dim=-1)


def reduce_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    per_token_loss: bool,
    num_samples: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
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
