"""Activation checkpointing of the torch backend's models (--recompute-granularity full).

The torch backend trains Hugging Face models, whose decoder layers each know how to recompute themselves
(``gradient_checkpointing_enable``): a layer keeps only its input for the backward pass and reruns its
forward there. That is Megatron's ``full`` granularity with ``uniform`` method and one layer per group, the
only shape HF offers. ``selective`` (Megatron recomputes the attention core only) has no HF counterpart and
is refused at start-up (vime.config.check_torch_recompute) rather than silently meaning something else.
"""

from __future__ import annotations

import torch

# Megatron's flag values and what the torch backend makes of them.
SUPPORTED = ("full",)


def enable_full_recompute(module: torch.nn.Module) -> None:
    """Recompute every decoder layer of ``module`` (an HF ``PreTrainedModel``: a causal LM, or the critic's
    body) in the backward pass. Only training forwards (``module.training``) recompute: the no-grad passes
    of old and reference log-probs keep nothing to recompute anyway."""
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"--recompute-granularity full: {type(module).__name__} does not support activation "
            "checkpointing in transformers; run without the flag"
        )
    # Non-reentrant checkpointing: gradients reach the parameters without the inputs requiring grad, and it
    # composes with the rest of autograd (saved-tensor hooks, the chunked log-probs' own recomputation).
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
