"""Score centering (arXiv:2609.20807): the correction term and its diagnostics, as pure functions.

REINFORCE's per-token gradient A * w(y) * grad log p(y) (y drawn from the sampler q, w an optional
importance weight) has expectation under q that is not zero when q differs from the trainer's p. Score
centering subtracts that expectation, E_{y~q}[w(y) grad log p(y)], which leaves the expected update
unchanged where q = p and removes the drift caused by the training-inference mismatch.

The expectation needs q over the whole vocabulary, but the sampler records only its top-k head. The
tail is modelled as proportional to the trainer's tail, q(y) = rho p(y) with
rho = (1 - q_head_mass) / (1 - p_head_mass). Since sum_y p(y) grad log p(y) = 0, the tail's part folds
into the head and the centred term is sum_{y in head} sg(q w - alpha p) log p, alpha = rho w(1 / rho).

With top-p replay the sampler records its complete support, normalised on it; the trainer normalises
on the same support and the correction is exact on it: sum_{y in support} sg(q w - w(1) p) log p.

``correction`` is differentiable (through the trainer's log-probs only); the loss adds
``A * correction`` per token.
"""

from __future__ import annotations

import torch

from vime.rl.tis import builtin_tis_mode, importance_weights


def weighting(use_tis: bool, custom_tis_function_path: str | None, tis_clip_low: float, tis_clip: float) -> dict:
    """The importance-weight rule shared by the sampled score and the centred scores."""
    if not use_tis:
        return {"mode": "none"}
    mode = builtin_tis_mode(custom_tis_function_path)
    if mode is None:
        raise ValueError("score centering supports the built-in TIS and icepop_function only")
    return {"mode": mode, "low": tis_clip_low, "high": tis_clip}


def topk_correction(
    train_head_log_probs: torch.Tensor,
    sampler_head_log_probs: torch.Tensor,
    *,
    mode: str = "none",
    low: float | None = None,
    high: float | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head correction with the modelled tail, per token.

    Both inputs are [tokens, k] log-probs normalised over the whole vocabulary, at the sampler's head
    token ids. Returns (correction [tokens], sampler head mass, trainer head mass); the masses are
    detached. Tail masses are floored at ``eps`` so that a head holding all the mass stays finite.
    """
    with torch.no_grad():
        train = train_head_log_probs.detach()
        p, q = train.exp(), sampler_head_log_probs.exp()
        p_mass, q_mass = p.sum(-1), q.sum(-1)
        rho = (1 - q_mass).clamp(min=eps) / (1 - p_mass).clamp(min=eps)
        alpha = rho * importance_weights(rho.reciprocal(), mode, low, high)
        weights = importance_weights((train - sampler_head_log_probs).exp(), mode, low, high)
        residual = q * weights - alpha.unsqueeze(-1) * p
    return (residual * train_head_log_probs).sum(-1), q_mass, p_mass


def support_correction(
    train_support_log_probs: torch.Tensor,
    sampler_support_log_probs: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str = "none",
    low: float | None = None,
    high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact correction on a recorded top-p support (ragged rows).

    Token ``t``'s support is entries ``offsets[t]:offsets[t + 1]`` of the flat inputs; both are
    log-probs normalised on that support. Returns (correction, sampler mass, trainer mass) per token.
    """
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    num_rows = lengths.numel()
    with torch.no_grad():
        train = train_support_log_probs.detach()
        p, q = train.exp(), sampler_support_log_probs.exp()
        weights = importance_weights((train - sampler_support_log_probs).exp(), mode, low, high)
        weight_at_one = importance_weights(torch.ones((), dtype=p.dtype), mode, low, high)
        residual = q * weights - weight_at_one * p
        q_mass = q.new_zeros(num_rows).index_add_(0, rows, q)
        p_mass = p.new_zeros(num_rows).index_add_(0, rows, p)
    correction = train_support_log_probs.new_zeros(num_rows).index_add(0, rows, residual * train_support_log_probs)
    return correction, q_mass, p_mass


def sampled_importance_weight(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    *,
    mode: str = "none",
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """The weight of the sampled token under the same rule (the ``sc_importance_weight`` metric)."""
    return importance_weights(torch.exp(log_probs.detach() - rollout_log_probs), mode, low, high)
