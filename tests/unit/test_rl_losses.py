"""Policy losses, KL estimators and entropy against float64 references written from the papers' formulas."""

import math

import pytest
import torch

from vime.rl.kl import approx_kl
from vime.rl.losses import (
    cispo_loss,
    gspo_loss,
    nll_loss,
    ppo_clip_loss,
    reduce_loss,
    reinforce_loss,
    sequence_log_ratio,
    token_entropy,
)

F64 = torch.float64

# Two ragged sequences padded to 4 tokens; the second has a masked (tool) token and padding.
LOGP = [[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.5, -0.2, 0.0]]
OLD = [[-1.2, -0.1, -2.0, -0.9], [-0.9, -0.4, -0.6, 0.0]]
ADV = [[0.8, 0.8, 0.8, 0.8], [-1.3, -1.3, -1.3, 0.0]]
MASK = [[1, 1, 1, 1], [1, 0, 1, 0]]


def t(rows):
    return torch.tensor(rows, dtype=F64)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    logp, old, adv = t([[0.0, 0.0, 0.0]]), t([[-3.0, -3.0, 0.5]]), t([[-1.0, 2.0, -1.0]])
    loss, _ = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_c=3.0)
    expected = []
    for lp, o, a in zip(logp[0].tolist(), old[0].tolist(), adv[0].tolist()):
        r = math.exp(lp - o)
        value = max(-r * a, -min(max(r, 0.8), 1.2) * a)
        if a < 0:
            value = min(value, -3.0 * a)
        expected.append(value)
    assert loss[0].tolist() == pytest.approx(expected)
    assert loss[0, 0].item() == pytest.approx(3.0)  # ratio e^3 on A = -1 would give 20.1 without the cap


def ref_gspo(logp, old, adv, mask, eps_low, eps_high):
    out = []
    for lps, olds, advs, ms in zip(logp, old, adv, mask):
        n = sum(ms)
        s = math.exp(sum((lp - o) * m for lp, o, m in zip(lps, olds, ms)) / n)
        out.append([max(-s * a, -min(max(s, 1 - eps_low), 1 + eps_high) * a) for a in advs])
    return out


@pytest.mark.parametrize("eps", [(0.2, 0.3), (3e-4, 4e-4)])
def test_gspo_clips_the_sequence_ratio(eps):
    loss, clipped = gspo_loss(t(LOGP), t(OLD), t(ADV), t(MASK), eps_clip=eps[0], eps_clip_high=eps[1])
    assert torch.allclose(loss, t(ref_gspo(LOGP, OLD, ADV, MASK, *eps)))
    # One ratio per sequence: every token of a sequence is clipped or none is.
    assert all(len(set(row.tolist())) == 1 for row in clipped)


def test_gspo_gradient_is_the_sequence_ratio_spread_over_its_tokens():
    logp = t(LOGP).requires_grad_()
    loss, _ = gspo_loss(logp, t(OLD), t(ADV), t(MASK), eps_clip=10.0)  # wide clip: nothing clipped
    reduce_loss(loss, t(MASK), per_token_loss=False).backward()
    expected = []
    for lps, olds, advs, ms in zip(LOGP, OLD, ADV, MASK):
        n = sum(ms)
        s = math.exp(sum((lp - o) * m for lp, o, m in zip(lps, olds, ms)) / n)
        # per-sample loss = -s A (constant over tokens); d s / d logp_t = s m_t / n; then / 2 samples
        expected.append([-advs[0] * s * m / n / 2 for m in ms])
    assert torch.allclose(logp.grad, t(expected))


def test_gradcheck_of_gspo():
    # (CISPO's weight is a stop-gradient constant, so its analytic gradient differs from finite differences
    # on purpose; test_cispo_keeps_the_gradient_of_clipped_tokens checks it instead.)
    old, adv, mask = t(OLD), t(ADV), t(MASK)
    logp = t(LOGP).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: gspo_loss(x, old, adv, mask, eps_clip=0.1)[0], (logp,))
    assert torch.autograd.gradcheck(lambda x: sequence_log_ratio(x, old, mask), (logp,))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    logp, old, adv = t([[0.0, 0.0, 0.0]]), t([[-1.0, 0.05, 1.0]]), t([[2.0, 2.0, -1.0]])
    x = logp.clone().requires_grad_()
    loss, clipped = cispo_loss(x, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    expected_weights = [min(max(math.exp(0 - o), 0.8), 1.28) for o in old[0].tolist()]
    assert loss[0].tolist() == pytest.approx([-w * a * 0.0 for w, a in zip(expected_weights, adv[0].tolist())])
    assert clipped[0].tolist() == [1.0, 0.0, 1.0]
    loss.sum().backward()
    # d/dlogp of -sg(w) A logp = -w A, even where the ratio was clipped
    assert x.grad[0].tolist() == pytest.approx([-w * a for w, a in zip(expected_weights, adv[0].tolist())])
    # PPO drops the clipped tokens' gradient: that is the difference CISPO makes
    y = logp.clone().requires_grad_()
    ppo_clip_loss(y, old, adv, eps_clip=0.2, eps_clip_high=0.28)[0].sum().backward()
    assert y.grad[0, 0] == 0 and x.grad[0, 0] != 0


def test_reinforce_and_nll_gradients():
    x = t(LOGP).requires_grad_()
    reinforce_loss(x, t(ADV)).sum().backward()
    assert torch.equal(x.grad, -t(ADV))
    y = t(LOGP).requires_grad_()
    loss = reduce_loss(nll_loss(y), t(MASK), per_token_loss=True)
    assert loss.item() == pytest.approx(-sum(lp * m for r, ms in zip(LOGP, MASK) for lp, m in zip(r, ms)) / 6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp, ref = t([[-1.0, -0.2, -30.0]]), t([[-1.5, -0.2, -5.0]])
    got = approx_kl(logp, ref, kind)[0].tolist()
    expected = []
    for a, b in zip(logp[0].tolist(), ref[0].tolist()):
        x = a - b
        value = {"k1": x, "k2": x * x / 2}.get(kind, math.exp(-x) - 1 + x)
        expected.append(min(max(value, -10), 10) if kind == "low_var_kl" else value)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[1] == 0  # identical policies: zero KL under every estimator
    with pytest.raises(ValueError, match="k3"):
        approx_kl(logp, ref, "k4")


def test_k3_is_an_unbiased_estimate_of_the_kl():
    # E_{y~p}[k3] = KL(p || ref) exactly, on a 3-token distribution.
    p, ref = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
    logp, logref = t([[math.log(v) for v in p]]), t([[math.log(v) for v in ref]])
    expectation = sum(pi * k for pi, k in zip(p, approx_kl(logp, logref, "k3")[0].tolist()))
    assert expectation == pytest.approx(sum(pi * math.log(pi / ri) for pi, ri in zip(p, ref)))


def test_entropy_of_each_position():
    logits = t([[[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]]])
    got = token_entropy(torch.log_softmax(logits, -1))[0].tolist()
    expected = []
    for row in logits[0].tolist():
        z = sum(math.exp(v) for v in row)
        expected.append(-sum(math.exp(v) / z * math.log(math.exp(v) / z) for v in row))
    assert got == pytest.approx(expected)
    assert got[1] == pytest.approx(math.log(3))
