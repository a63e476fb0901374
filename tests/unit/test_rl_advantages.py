"""Advantage estimators against float64 references written from the papers' definitions with plain loops."""

import math

import pytest
import torch

from vime.rl.advantages import (
    compute_advantages,
    discounted_returns,
    gae_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    whiten_ragged,
)

F64 = torch.float64

# Three groups of three samples with ragged responses; a masked (tool) token inside sample 1, a fully
# masked tail in sample 4, all-equal rewards in the second group.
REWARDS = [1.0, 0.0, 0.5, 0.7, 0.7, 0.7, 0.0, 1.0, 0.25]
MASKS = [[1, 1, 1], [1, 0, 1, 1], [1], [1, 1], [1, 1, 0, 0], [1, 1, 1, 1, 1], [1], [0, 1, 1], [1, 1]]
KL = [[0.1 * (i + 1) - 0.05 * t for t in range(len(m))] for i, m in enumerate(MASKS)]


def tensors(rows):
    return [torch.tensor(r, dtype=F64) for r in rows]


def ref_group_stats(rewards, size):
    stats = []
    for start in range(0, len(rewards), size):
        group = rewards[start : start + size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        stats += [(mean, std)] * len(group)
    return stats


def ref_whiten(values, masks):
    n = sum(sum(m) for m in masks)
    mean = sum(v * m for vs, ms in zip(values, masks) for v, m in zip(vs, ms)) / n
    var = sum(((v - mean) ** 2) * m for vs, ms in zip(values, masks) for v, m in zip(vs, ms)) / n
    return [[(v - mean) / math.sqrt(var + 1e-8) * m for v, m in zip(vs, ms)] for vs, ms in zip(values, masks)]


def ref_last_trained(mask):
    return max(i for i, m in enumerate(mask) if m) if any(mask) else len(mask) - 1


def ref_reinforce_pp(rewards, kl, masks, beta, gamma):
    """REINFORCE++: r_t = -beta KL_t (trained tokens) + R at the last trained token; G_t = sum_s gamma^(s-t) r_s."""
    out = []
    for reward, kls, mask in zip(rewards, kl, masks):
        r = [-beta * k * m for k, m in zip(kls, mask)]
        r[ref_last_trained(mask)] += reward
        out.append([sum(gamma ** (s - t) * r[s] for s in range(t, len(r))) * mask[t] for t in range(len(r))])
    return out


def assert_close(got, expected, tol=1e-9):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.allclose(g, torch.tensor(e, dtype=F64), atol=tol), (g, e)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_estimators_put_the_normalised_reward_on_every_trained_token(estimator, normalize_std):
    got = compute_advantages(
        estimator, torch.tensor(REWARDS, dtype=F64), tensors(MASKS), group_size=3, normalize_std=normalize_std
    )
    expected = []
    for reward, (mean, std), mask in zip(REWARDS, ref_group_stats(REWARDS, 3), MASKS):
        value = (reward - mean) / (std + 1e-6) if normalize_std else reward - mean
        expected.append([value * m for m in mask])
    assert_close(got, expected)
    assert all(torch.all(a == 0) for a in got[3:6])  # all-equal rewards carry no signal


def test_single_sample_groups_have_no_group_signal():
    got = compute_advantages("grpo", torch.tensor([0.3, 0.9], dtype=F64), tensors([[1, 1], [1]]), group_size=1)
    assert all(torch.all(a == 0) for a in got)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_discounted_kl_penalised_returns(gamma):
    beta = 0.2
    raw = reinforce_plus_plus_returns(
        torch.tensor(REWARDS, dtype=F64), tensors(KL), tensors(MASKS), kl_coef=beta, gamma=gamma
    )
    assert_close(
        [a * torch.tensor(m, dtype=F64) for a, m in zip(raw, MASKS)], ref_reinforce_pp(REWARDS, KL, MASKS, beta, gamma)
    )
    got = compute_advantages(
        "reinforce_plus_plus",
        torch.tensor(REWARDS, dtype=F64),
        tensors(MASKS),
        group_size=3,
        kl=tensors(KL),
        kl_coef=beta,
        gamma=gamma,
        normalize=True,
    )
    assert_close(got, ref_whiten(ref_reinforce_pp(REWARDS, KL, MASKS, beta, gamma), MASKS))


def test_reinforce_plus_plus_pays_the_reward_on_the_last_trained_token():
    # Sample 4's last two tokens are masked: the reward lands on token 1, and token 0 sees it undiscounted.
    (returns,) = reinforce_plus_plus_returns(
        torch.tensor([2.0], dtype=F64), tensors([[0, 0, 0, 0]]), tensors([[1, 1, 0, 0]]), kl_coef=0.0, gamma=0.5
    )
    assert returns.tolist() == [1.0, 2.0, 0.0, 0.0]


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens():
    beta = 0.1
    raw = reinforce_plus_plus_baseline_advantages(
        torch.tensor(REWARDS, dtype=F64), tensors(KL), tensors(MASKS), group_size=3, kl_coef=beta
    )
    expected_raw = [
        [(reward - mean - beta * k) * m for k, m in zip(kls, mask)]
        for reward, (mean, _), kls, mask in zip(REWARDS, ref_group_stats(REWARDS, 3), KL, MASKS)
    ]
    assert_close(raw, expected_raw)
    got = compute_advantages(
        "reinforce_plus_plus_baseline",
        torch.tensor(REWARDS, dtype=F64),
        tensors(MASKS),
        group_size=3,
        kl=tensors(KL),
        kl_coef=beta,
        normalize=True,
    )
    assert_close(got, ref_whiten(expected_raw, MASKS))
    flat = torch.cat(got)[torch.cat(tensors(MASKS)) > 0]
    assert abs(float(flat.mean())) < 1e-9 and float((flat**2).mean()) == pytest.approx(1.0, rel=1e-6)


def test_whitening_ignores_masked_tokens_and_zeroes_them():
    values = tensors([[1.0, 100.0, 3.0], [2.0]])
    got = whiten_ragged(values, tensors([[1, 0, 1], [1]]))
    assert got[0][1] == 0
    assert_close(got, ref_whiten([[1.0, 100.0, 3.0], [2.0]], [[1, 0, 1], [1]]))


def test_gae_matches_the_sum_of_discounted_td_errors():
    rewards = [[0.0, 0.5, 1.0], [0.2, -1.0]]
    values = [[0.3, 0.1, -0.2], [0.5, 0.4]]
    gamma, lambd = 0.9, 0.8
    advantages, returns = gae_advantages(tensors(rewards), tensors(values), gamma=gamma, lambd=lambd)
    expected = []
    for r, v in zip(rewards, values):
        n = len(r)
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        expected.append([sum((gamma * lambd) ** (s - t) * delta[s] for s in range(t, n)) for t in range(n)])
    assert_close(advantages, expected)
    assert_close(returns, [[a + b for a, b in zip(e, v)] for e, v in zip(expected, values)])


def test_discounted_returns_of_a_single_reward():
    (returns,) = discounted_returns([torch.tensor([0.0, 0.0, 1.0], dtype=F64)], gamma=0.5)
    assert returns.tolist() == [0.25, 0.5, 1.0]


def test_misuse_is_refused():
    masks = tensors([[1], [1]])
    with pytest.raises(ValueError, match="kl_coef"):
        compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0], dtype=F64), masks, group_size=2, kl_coef=0.1)
    with pytest.raises(NotImplementedError, match="critic"):
        compute_advantages("ppo", torch.tensor([1.0, 0.0], dtype=F64), masks, group_size=2)
    with pytest.raises(ValueError, match="unknown"):
        compute_advantages("magic", torch.tensor([1.0, 0.0], dtype=F64), masks, group_size=2)
    with pytest.raises(ValueError, match="groups of 2"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0], dtype=F64), tensors([[1], [1], [1]]), group_size=2)
