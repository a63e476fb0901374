"""Advantage estimators (pure functions on tensors, shared by every training backend).

Samples are ordered group by group (``group_size`` = --n-samples-per-prompt consecutive samples share a
prompt). Token-level quantities are ragged: one 1-D tensor per sample over its response tokens, with a
loss mask of the same length (0 on tokens the policy did not choose, e.g. tool output). Formulas and
references: docs/algorithms.md.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
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
    # The mean of equal values may differ from them in the last bit; std normalisation would blow that up.
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    centred = centred.masked_fill(all_equal, 0.0)
    return centred.view(-1).to(rewards.dtype)


def broadcast_to_tokens(per_sample: torch.Tensor, loss_masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sample's scalar on each of its response tokens (0 where the loss mask is 0)."""
    return [value * mask.to(per_sample.dtype) for value, mask in zip(per_sample, loss_masks, strict=True)]


def _last_trained_index(mask: torch.Tensor) -> int:
    """Where the sequence reward is paid: the last loss-masked token (the last token if none is)."""
    trained = torch.nonzero(mask > 0)
    return int(trained[-1]) if len(trained) else mask.numel() - 1


def kl_penalised_token_rewards(
    rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """r_t = -kl_coef * KL_t on trained tokens, plus the sequence reward on the last trained token."""
    out = []
    for reward, kl_i, mask in zip(rewards, kl, loss_masks, strict=True):
        token_rewards = -kl_coef * kl_i * mask.to(kl_i.dtype)
        if token_rewards.numel():
            index = _last_trained_index(mask)
            token_rewards = token_rewards.clone()
            token_rewards[index] = token_rewards[index] + reward
        out.append(token_rewards)
    return out


def discounted_returns(token_rewards: list[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """G_t = r_t + gamma * G_{t+1}, G past the end = 0."""
    out = []
    for r in token_rewards:
        # A loop over Python floats: no gradient flows here, and it is far faster than per-element tensor ops.
        returns, running = [], 0.0
        for reward in reversed(r.tolist()):
            running = reward + gamma * running
            returns.append(running)
        out.append(torch.tensor(returns[::-1], dtype=r.dtype))
    return out


def reinforce_plus_plus_returns(
    rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor], *, kl_coef: float, gamma: float
) -> list[torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262) before whitening: discounted returns of the KL-penalised token rewards."""
    return discounted_returns(kl_penalised_token_rewards(rewards, kl, loss_masks, kl_coef), gamma)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    group_size: int,
    kl_coef: float,
    group_baseline: bool = True,
) -> list[torch.Tensor]:
    """REINFORCE++-baseline before whitening: (reward - group mean) - kl_coef * KL_t on every trained token
    (``group_baseline=False``: the rewards come centred already, e.g. from --custom-reward-post-process-path)."""
    centred = grpo_advantages(rewards, group_size, normalize_std=False) if group_baseline else rewards
    return [
        (value - kl_coef * kl_i) * mask.to(kl_i.dtype)
        for value, kl_i, mask in zip(centred, kl, loss_masks, strict=True)
    ]


def gae_advantages(
    token_rewards: list[torch.Tensor], values: list[torch.Tensor], *, gamma: float, lambd: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation (PPO): A_t = sum_l (gamma lambd)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t with V past the end = 0. Returns (advantages, returns = A + V)."""
    advantages, returns = [], []
    for r, v in zip(token_rewards, values, strict=True):
        rewards_t, values_t = r.tolist(), v.tolist()
        adv, running = [0.0] * len(rewards_t), 0.0
        for t in range(len(rewards_t) - 1, -1, -1):
            next_value = values_t[t + 1] if t + 1 < len(values_t) else 0.0
            running = rewards_t[t] + gamma * next_value - values_t[t] + gamma * lambd * running
            adv[t] = running
        adv_tensor = torch.tensor(adv, dtype=r.dtype)
        advantages.append(adv_tensor)
        returns.append(adv_tensor + v)
    return advantages, returns


def ppo_advantages_and_returns(
    rewards: torch.Tensor,
    values: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO before whitening: GAE over the KL-shaped token rewards with the critic's ``values``.

    Returns (advantages, returns): advantages are 0 where the loss mask is 0; returns = A + V on every
    response token are the critic's regression targets (its loss counts the trained tokens only).
    """
    if kl is None:
        if kl_coef:
            raise ValueError("kl_coef needs the per-token KL to the reference model")
        kl = [torch.zeros(m.shape, dtype=rewards.dtype) for m in loss_masks]
    token_rewards = kl_penalised_token_rewards(rewards, kl, loss_masks, kl_coef)
    advantages, returns = gae_advantages(token_rewards, values, gamma=gamma, lambd=lambd)
    return [a * m.to(a.dtype) for a, m in zip(advantages, loss_masks, strict=True)], returns


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the masked entries (--normalize-advantages)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) * torch.rsqrt(var + eps) * mask


def whiten_ragged(values: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`whiten` over the trained tokens of all samples together."""
    if not values:
        return []
    flat = whiten(torch.cat(values), torch.cat(loss_masks))
    return list(flat.split([v.numel() for v in values]))


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    loss_masks: list[torch.Tensor],
    *,
    group_size: int,
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    normalize_std: bool = True,
    normalize: bool = False,
    values: list[torch.Tensor] | None = None,
    group_baseline: bool = True,
) -> list[torch.Tensor]:
    """Token-level advantages of one rollout for ``--advantage-estimator``.

    ``kl`` (per token, policy vs reference) is needed when ``kl_coef`` is not 0; ``values`` (critic) for
    'ppo'. ``normalize`` whitens the result over all trained tokens (--normalize-advantages).
    ``group_baseline=False``: the rewards were normalised already (--custom-reward-post-process-path), so
    grpo/gspo/cispo take them as the advantages and reinforce_plus_plus_baseline subtracts no group mean.
    """
    if kl is None:
        if kl_coef:
            raise ValueError("kl_coef needs the per-token KL to the reference model")
        kl = [torch.zeros(m.shape, dtype=rewards.dtype) for m in loss_masks]
    if estimator in ("grpo", "gspo", "cispo"):
        per_sample = grpo_advantages(rewards, group_size, normalize_std=normalize_std) if group_baseline else rewards
        advantages = broadcast_to_tokens(per_sample, loss_masks)
    elif estimator == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_returns(rewards, kl, loss_masks, kl_coef=kl_coef, gamma=gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = reinforce_plus_plus_baseline_advantages(
            rewards, kl, loss_masks, group_size=group_size, kl_coef=kl_coef, group_baseline=group_baseline
        )
    elif estimator == "ppo":
        if values is None:
            raise NotImplementedError("--advantage-estimator ppo needs the critic's values (values=...)")
        token_rewards = kl_penalised_token_rewards(rewards, kl, loss_masks, kl_coef)
        advantages, _ = gae_advantages(token_rewards, values, gamma=gamma, lambd=lambd)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    advantages = [a * m.to(a.dtype) for a, m in zip(advantages, loss_masks, strict=True)]
    return whiten_ragged(advantages, loss_masks) if normalize else advantages
