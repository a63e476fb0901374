"""Truncated importance sampling, its plug-in loader, and --mask-offpolicy-in-partial-rollout's mask."""

import argparse
import math

import pytest
import torch

from vime.rl.offpolicy import onpolicy_loss_mask
from vime.rl.tis import builtin_tis_mode, icepop_function, importance_weights, load_tis_function, vanilla_tis_function
from vime.runtime.plugins import PluginError

F64 = torch.float64
ARGS = argparse.Namespace(tis_clip=2.0, tis_clip_low=0.5)
# Two samples; ratios trainer/sampler = 0.1, 1.0, 3.0 | 0.6, 2.5
TRAIN = [[math.log(0.1), 0.0, math.log(3.0)], [math.log(0.6), math.log(2.5)]]
ROLLOUT = [[0.0, 0.0, 0.0], [0.0, 0.0]]


def call(function):
    pg_loss = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=F64, requires_grad=True)
    masks = [torch.ones(3), torch.ones(2)]
    out, out_masks, metrics = function(
        ARGS,
        pg_loss=pg_loss,
        train_log_probs=[torch.tensor(r, dtype=F64) for r in TRAIN],
        rollout_log_probs=[torch.tensor(r, dtype=F64) for r in ROLLOUT],
        loss_masks=masks,
        total_lengths=[5, 4],
        response_lengths=[3, 2],
    )
    assert out_masks is masks
    return pg_loss, out, metrics


def test_vanilla_tis_clips_the_ratio_into_its_bounds():
    pg_loss, out, metrics = call(vanilla_tis_function)
    ratios = [0.1, 1.0, 3.0, 0.6, 2.5]
    weights = [min(max(r, 0.5), 2.0) for r in ratios]
    assert out.tolist() == pytest.approx([p * w for p, w in zip(pg_loss.tolist(), weights)])
    assert metrics["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert metrics["tis"].tolist() == pytest.approx(ratios)
    out.sum().backward()  # the weight is a constant: d out / d pg_loss = weight
    assert pg_loss.grad.tolist() == pytest.approx(weights)


def test_icepop_drops_tokens_outside_the_bounds():
    pg_loss, out, metrics = call(icepop_function)
    assert out.tolist() == pytest.approx([0.0, -2.0, 0.0, 3.0 * 0.6, 0.0])
    assert metrics["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_importance_weight_modes():
    ratio = torch.tensor([0.2, 1.0, 4.0], dtype=F64)
    assert importance_weights(ratio, "none").tolist() == [1.0, 1.0, 1.0]
    assert importance_weights(ratio, "tis", 0.5, 2.0).tolist() == [0.5, 1.0, 2.0]
    assert importance_weights(ratio, "mis", 0.5, 2.0).tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        importance_weights(ratio, "other")


def test_tis_function_loading(tmp_path):
    assert load_tis_function(None) is vanilla_tis_function
    assert load_tis_function("vime.backends.megatron_utils.loss.icepop_function") is icepop_function  # seeds' name
    assert builtin_tis_mode("vime.rl.tis.icepop_function") == "mis"
    plugin = tmp_path / "my_tis.py"
    plugin.write_text("def weigh(args, *, pg_loss, loss_masks, **kwargs):\n    return pg_loss * 0, loss_masks, {}\n")
    function = load_tis_function(f"{plugin}:weigh")
    assert builtin_tis_mode(f"{plugin}:weigh") is None
    assert function(ARGS, pg_loss=torch.ones(2), loss_masks=[])[0].tolist() == [0.0, 0.0]
    with pytest.raises(PluginError, match="--custom-tis-function-path"):
        load_tis_function(f"{plugin}:missing")


def test_offpolicy_mask_zeroes_exactly_the_older_tokens():
    # A continuation: 3 tokens from version 4, then 2 from version 5, one of which was already masked (tool).
    mask = onpolicy_loss_mask([1, 1, 1, 0, 1], [4, 4, 4, 5, 5], policy_version=5)
    assert mask == [0, 0, 0, 0, 1]
    assert onpolicy_loss_mask([1, 0, 1], [7, 7, 7], policy_version=7) == [1, 0, 1]
    assert onpolicy_loss_mask([1, 1], [2, 3], policy_version=4) == [0, 0]
    with pytest.raises(ValueError, match="weight versions"):
        onpolicy_loss_mask([1, 1, 1], [1, 1], policy_version=1)
