"""--mask-offpolicy-in-partial-rollout: train only on the tokens of the policy being trained.

A sample resumed from a continuation (partial rollout), or generated while the trainer moved on,
holds tokens produced by older weights. Each response token carries the weight version that
produced it; tokens older than the policy version under training get loss mask 0.
"""

from __future__ import annotations


def onpolicy_loss_mask(loss_mask: list[int], weight_versions: list[int], policy_version: int) -> list[int]:
    """``loss_mask`` with 0 on every token whose weight version is older than ``policy_version``."""
    if len(loss_mask) != len(weight_versions):
        raise ValueError(f"{len(weight_versions)} weight versions for {len(loss_mask)} response tokens")
    return [m if version >= policy_version else 0 for m, version in zip(loss_mask, weight_versions)]
