"""GRPO advantages and the clipped policy loss against float64 references written from the formulas."""

import math

import pytest
import torch

from vime.rl.advantages import grpo_advantages, whiten
from vime.rl.losses import ppo_clip_loss, reduce_loss


def reference_grpo(rewards, group, normalize=True, eps=1e-6):
    out = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean = sum(chunk) / len(chunk)
        std = math.sqrt(sum((r - mean) ** 2 for r in chunk) / (len(chunk) - 1)) if len(chunk) > 1 else 0.0
        out.extend((r - mean) / (std + eps) if normalize and len(chunk) > 1 else r - mean for r in chunk)
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_matches_reference(normalize):
    rewards = [1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0, 0.0, 0.3, 0.9, 0.1]
    got = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), 4, normalize_std=normalize)
    assert torch.allclose(got, torch.tensor(reference_grpo(rewards, 4, normalize), dtype=torch.float64))
    assert torch.all(got[4:8] == 0)  # all-equal rewards: no signal


def test_grpo_single_sample_groups_and_bad_shapes():
    assert torch.equal(grpo_advantages(torch.tensor([0.3, 0.7]), 1), torch.zeros(2))
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_ppo_clip_loss_matches_formula():
    logp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.2, -0.1, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_loss(logp, old, adv, eps_clip=0.1, eps_clip_high=0.15)
    expected, expected_clip = [], []
    for lp, o, a in zip(logp[0].tolist(), old[0].tolist(), adv[0].tolist()):
        r = math.exp(lp - o)
        unclipped, clip = r * a, min(max(r, 0.9), 1.15) * a
        expected.append(-min(unclipped, clip))
        expected_clip.append(float(clip < unclipped))
    assert torch.allclose(loss[0], torch.tensor(expected, dtype=torch.float64))
    assert clipped[0].tolist() == expected_clip


def test_on_policy_gradient_is_advantage_weighted_score():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[0.5, -1.5]], dtype=torch.float64)
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, eps_clip=0.2)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)


def test_gradcheck_of_the_clipped_loss():
    old = torch.tensor([[-1.0, -0.3, -2.0, -0.7]], dtype=torch.float64)
    adv = torch.tensor([[0.7, -1.1, 0.4, 2.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.05, -0.03, 0.5, -0.4]], dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ppo_clip_loss(x, old, adv, eps_clip=0.2)[0], (logp,))


def test_reductions_per_sample_and_per_token():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert reduce_loss(per_token, mask, per_token_loss=False).item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert reduce_loss(per_token, mask, per_token_loss=True).item() == pytest.approx(10 / 4)
    # micro-batches add up to the whole batch
    halves = [reduce_loss(per_token[i : i + 1], mask[i : i + 1], per_token_loss=False, num_samples=2) for i in (0, 1)]
    assert sum(halves).item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    tokens = [reduce_loss(per_token[i : i + 1], mask[i : i + 1], per_token_loss=True, num_tokens=4) for i in (0, 1)]
    assert sum(tokens).item() == pytest.approx(10 / 4)


def test_whiten_only_counts_masked_entries():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    out = whiten(values, mask)
    assert out[3] == 0
    assert out[:3].mean().abs() < 1e-9 and (out[:3] ** 2).mean() == pytest.approx(1.0, rel=1e-6)
