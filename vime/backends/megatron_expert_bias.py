"""The MoE routers' expert bias (``--moe-router-enable-expert-bias``, GLM-4.5's ``e_score_correction_bias``).

A sigmoid router with an expert bias picks each token's top-k experts by score plus bias, while the weights
come from the scores alone, so the bias steers load without entering the loss: no gradient reaches it. It is
balanced the aux-loss-free way instead, as megatron-core's own training loop does in ``finalize_model_grads``:
during the step's training forwards each router counts the tokens it sent to each expert; after the step's
backward passes the counts are summed over the tensor, data and context-parallel ranks, and every expert's bias
moves by ``--moe-router-bias-update-rate`` toward balance (up for an expert below the mean load, down above
it; megatron-core's ``get_updated_expert_bias``). The counts then start again from zero.

megatron-core 0.16's own count (``TopKRouter._apply_expert_bias``) fails on a padded batch (it masks the
[tokens, experts] routing map with the [tokens] padding mask without broadcasting), so :func:`count_loads`
turns it off and counts in a forward hook instead, leaving padding out as megatron-core means to.

The bias is a model tensor like any weight: loaded from and exported to the HF checkpoint
(``vime.backends.megatron_convert``), gathered for the engines, and saved in checkpoints.
"""

from __future__ import annotations

import torch


def biased_routers(model) -> list:
    """The routers of ``model`` (a GPTModel) that route with an expert bias, in layer order."""
    from vime.backends.megatron_routing import moe_routers

    return [r for r in moe_routers(model) if getattr(r, "expert_bias", None) is not None]


def count_loads(model) -> None:
    """Count each biased router's tokens per expert here (not in megatron-core: see the module's docstring)."""
    for router in biased_routers(model):
        router.enable_expert_bias = False  # only megatron-core's count: routing still adds router.expert_bias
        router.register_forward_hook(_count_load, with_kwargs=True)


def _count_load(router, args, kwargs, output) -> None:
    """A training forward (gradients on; log-prob passes are not counted): add the real tokens' experts."""
    if not torch.is_grad_enabled():
        return
    _, routing_map = output
    padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    chosen = routing_map.bool()
    if padding is not None:  # True for padding, [sequence, batch] as the router flattens its logits
        chosen = chosen & ~padding.reshape(-1, 1).bool()
    with torch.no_grad():
        router.local_tokens_per_expert += chosen.sum(dim=0).to(router.local_tokens_per_expert.dtype)


def update_expert_bias(model, rate: float) -> None:
    """After a step's backward passes: move every expert bias of ``model`` by ``rate`` toward balance (every rank
    of the tensor x data x context-parallel group calls it: the token counts are summed over it), then clear the
    routers' counts. ``rate`` 0 keeps the biases."""
    routers = biased_routers(model)
    if not routers:
        return
    with torch.no_grad():
        if rate > 0:
            from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

            counts = torch.stack([r.local_tokens_per_expert for r in routers])
            biases = torch.stack([r.expert_bias.float() for r in routers])
            for router, bias in zip(routers, get_updated_expert_bias(counts, biases, rate)):
                router.expert_bias.copy_(bias)
        for router in routers:
            router.local_tokens_per_expert.zero_()
