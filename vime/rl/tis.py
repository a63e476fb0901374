"""Importance-sampling corrections for the training-inference mismatch (--use-tis).

The sampler (vLLM) and the trainer compute slightly different probabilities for the same weights,
and in asynchronous training the sampler may also hold older weights. TIS
(https://fengyao.notion.site/off-policy-rl) multiplies each token's policy loss by the truncated
ratio ``clip(pi_trainer(y) / pi_sampler(y), low, high)``, detached, so that the update is the one the
trainer's policy would have made.

A TIS function has the reference framework's signature, so user functions written for it keep working:

    f(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths)
        -> (pg_loss, loss_masks, metrics)

``pg_loss`` is the per-token loss of every response token of a micro-batch, concatenated sample after
sample; the other per-sample arguments are lists with one 1-D tensor per sample (``loss_masks`` says
which tokens count). The
returned masks may drop tokens (rejection sampling): they leave the numerator of the loss, while the
per-sample denominators stay those of the original masks. ``metrics`` maps names to per-token tensors,
averaged like the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Built-in weighting rules, by every name a user may give them. The seeds name the Megatron backend's
# module; vime's torch backend resolves that name to the same function.
_VANILLA = ("vime.rl.tis.vanilla_tis_function", "vime.backends.megatron_utils.loss.vanilla_tis_function")
_ICEPOP = ("vime.rl.tis.icepop_function", "vime.backends.megatron_utils.loss.icepop_function")


def importance_weights(
    ratio: torch.Tensor, mode: str, low: float | None = None, high: float | None = None
) -> torch.Tensor:
    """Weights of importance ratios: 'none' -> 1, 'tis' -> clip(ratio, low, high),
    'mis' (masked, IcePop) -> ratio inside [low, high], 0 outside."""
    if mode == "none":
        return torch.ones_like(ratio)
    if mode == "tis":
        return ratio.clamp(min=low, max=high)
    if mode == "mis":
        return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    raise ValueError(f"unknown importance-weight mode {mode!r}")


def _weighted(
    args,
    mode: str,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
):
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).detach()
    weights = importance_weights(ratio, mode, args.tis_clip_low, args.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).to(ratio.dtype), "tis_abs": (ratio - 1).abs()}
    return pg_loss * weights, loss_masks, metrics


def vanilla_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_: Any):
    """Weight = clip(ratio, --tis-clip-low, --tis-clip)."""
    return _weighted(args, "tis", pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_: Any):
    """IcePop: weight = ratio when --tis-clip-low <= ratio <= --tis-clip, else 0 (the token is dropped)."""
    return _weighted(args, "mis", pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def builtin_tis_mode(path: str | None) -> str | None:
    """'tis' or 'mis' for the built-in functions (None = the default TIS), None for a user function."""
    if path is None or path in _VANILLA:
        return "tis"
    if path in _ICEPOP:
        return "mis"
    return None


def load_tis_function(path: str | None) -> Callable[..., Any]:
    mode = builtin_tis_mode(path)
    if mode == "tis":
        return vanilla_tis_function
    if mode == "mis":
        return icepop_function
    from vime.runtime.plugins import load_function

    return load_function(path, "--custom-tis-function-path", min_params=1)
