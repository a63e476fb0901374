"""Advantage estimators (pure functions on tensors, shared by every training backend)."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeek-Math): each reward minus its group's mean, divided by the group's std.

    ``rewards`` is ordered group by group ([num_groups * group_size]). A group whose rewards are all
    equal gets zero advantages. The std is the unbiased one, as in the reference implementations.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).to(torch.float64)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.view(-1).to(rewards.dtype)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the masked entries (--normalize-advantages)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) * torch.rsqrt(var + eps) * mask
