"""Score centering: the correction against loops over the paper's definitions, and the property it exists for
(its gradient is the sampler-expected weighted score E_{y~q}[w(y) grad log p(y)])."""

import math

import pytest
import torch

from vime.rl.score_centering import sampled_importance_weight, support_correction, topk_correction, weighting

F64 = torch.float64
LOGITS = [0.3, 1.2, -0.5, 0.8, -1.0, 0.1]   # trainer, vocabulary of 6
HEAD = [1, 3, 0]                             # the sampler's top-3 ids
SAMPLER_HEAD = [0.40, 0.20, 0.15]            # its probabilities there (full-vocabulary normalised)


def softmax(z):
    m = sum(math.exp(v) for v in z)
    return [math.exp(v) / m for v in z]


def weight(ratio, mode, low, high):
    if mode == "none":
        return 1.0
    if mode == "tis":
        return min(max(ratio, low), high)
    return ratio if low <= ratio <= high else 0.0


def ref_topk(p_head, q_head, mode, low, high, eps=1e-6):
    p_mass, q_mass = sum(p_head), sum(q_head)
    rho = max(1 - q_mass, eps) / max(1 - p_mass, eps)
    alpha = rho * weight(1 / rho, mode, low, high)
    correction = sum((q * weight(p / q, mode, low, high) - alpha * p) * math.log(p) for p, q in zip(p_head, q_head))
    return correction, q_mass, p_mass


MODES = [("none", None, None), ("tis", 0.5, 1.5), ("mis", 0.8, 1.2)]


@pytest.mark.parametrize("mode, low, high", MODES)
def test_topk_correction_matches_the_formula(mode, low, high):
    p = softmax(LOGITS)
    train_head = torch.tensor([[math.log(p[i]) for i in HEAD]], dtype=F64)
    sampler_head = torch.tensor([[math.log(q) for q in SAMPLER_HEAD]], dtype=F64)
    correction, q_mass, p_mass = topk_correction(train_head, sampler_head, mode=mode, low=low, high=high)
    expected = ref_topk([p[i] for i in HEAD], SAMPLER_HEAD, mode, low, high)
    assert [correction.item(), q_mass.item(), p_mass.item()] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode, low, high", MODES)
def test_topk_gradient_is_the_expected_score_when_the_tail_follows_the_trainer(mode, low, high):
    # Build a sampler whose tail is exactly rho * p: then the head-plus-modelled-tail term is exact.
    p = softmax(LOGITS)
    p_head_mass, q_head_mass = sum(p[i] for i in HEAD), sum(SAMPLER_HEAD)
    rho = (1 - q_head_mass) / (1 - p_head_mass)
    q = [rho * pi for pi in p]
    for i, qi in zip(HEAD, SAMPLER_HEAD):
        q[i] = qi
    assert sum(q) == pytest.approx(1.0)
    # E_{y~q}[w(p_y/q_y) d log p_y / d z] with d log p_y / d z_v = [v == y] - p_v
    expected = [sum(q[y] * weight(p[y] / q[y], mode, low, high) * ((v == y) - p[v]) for y in range(6))
                for v in range(6)]
    z = torch.tensor(LOGITS, dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[HEAD].unsqueeze(0)
    correction, _, _ = topk_correction(train_head, torch.tensor([[math.log(v) for v in SAMPLER_HEAD]], dtype=F64),
                                       mode=mode, low=low, high=high)
    correction.sum().backward()
    assert z.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_matching_distributions_need_no_centering():
    p = softmax(LOGITS)
    z = torch.tensor([LOGITS], dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[:, HEAD]
    correction, q_mass, p_mass = topk_correction(train_head, train_head.detach(), mode="tis", low=0.5, high=2.0)
    correction.sum().backward()
    assert abs(correction.item()) < 1e-12 and z.grad.abs().max() < 1e-12
    assert q_mass.item() == pytest.approx(p_mass.item()) == pytest.approx(sum(p[i] for i in HEAD))


def test_a_head_holding_all_the_mass_stays_finite():
    z = torch.tensor([[5.0, -50.0, -50.0]], dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[:, [0]]
    correction, _, _ = topk_correction(train_head, torch.zeros((1, 1), dtype=F64))  # sampler head mass 1
    correction.sum().backward()
    assert torch.isfinite(correction).all() and torch.isfinite(z.grad).all()


def ref_support(train_logits_rows, sampler_rows, mode, low, high):
    out = []
    for logits, q in zip(train_logits_rows, sampler_rows):
        p = softmax(logits)
        w1 = weight(1.0, mode, low, high)
        out.append(sum((qi * weight(pi / qi, mode, low, high) - w1 * pi) * math.log(pi) for pi, qi in zip(p, q)))
    return out


@pytest.mark.parametrize("mode, low, high", MODES)
def test_support_correction_on_ragged_top_p_supports(mode, low, high):
    logits_rows = [[0.5, 0.1, -0.3], [1.0], [0.2, 0.9]]       # supports of 3, 1 and 2 tokens
    sampler_rows = [[0.5, 0.3, 0.2], [1.0], [0.45, 0.55]]
    flat_logits = [torch.tensor(r, dtype=F64, requires_grad=True) for r in logits_rows]
    train = torch.cat([torch.log_softmax(r, -1) for r in flat_logits])
    sampler = torch.tensor([math.log(v) for r in sampler_rows for v in r], dtype=F64)
    correction, q_mass, p_mass = support_correction(train, sampler, torch.tensor([0, 3, 4, 6]),
                                                    mode=mode, low=low, high=high)
    assert correction.tolist() == pytest.approx(ref_support(logits_rows, sampler_rows, mode, low, high), abs=1e-12)
    assert q_mass.tolist() == pytest.approx([1.0, 1.0, 1.0]) and p_mass.tolist() == pytest.approx([1.0, 1.0, 1.0])
    correction.sum().backward()
    for logits, q, z in zip(logits_rows, sampler_rows, flat_logits):
        p = softmax(logits)
        expected = [sum(q[y] * weight(p[y] / q[y], mode, low, high) * ((v == y) - p[v]) for y in range(len(p)))
                    for v in range(len(p))]
        assert z.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_weighting_rules():
    assert weighting(False, None, 0.0, 2.0) == {"mode": "none"}
    assert weighting(True, None, 0.1, 2.0) == {"mode": "tis", "low": 0.1, "high": 2.0}
    assert weighting(True, "vime.rl.tis.icepop_function", 0.5, 2.0)["mode"] == "mis"
    with pytest.raises(ValueError, match="built-in"):
        weighting(True, "my.module.weigh", 0.5, 2.0)
    w = sampled_importance_weight(torch.tensor([0.0, 0.0]), torch.tensor([math.log(4.0), math.log(0.9)]),
                                  mode="tis", low=0.5, high=2.0)
    assert w.tolist() == pytest.approx([0.5, 1 / 0.9])
