"""Multi-latent attention (DeepSeek-V3, Moonlight) without Transformer Engine.

megatron-core builds MLA (``MLASelfAttention``) from its layer specs; its projections, latent norms and
(YaRN) rotary embedding run anywhere, but its attention core needs Transformer Engine's
``TEDotProductAttention``: megatron-core 0.16's own ``DotProductAttention`` takes neither MLA's separate key
and value head sizes (``k_channels``, ``v_channels``) nor its softmax scale. Where Transformer Engine is
not usable (CPU, or a GPU without it) the Megatron backend puts :class:`LatentCoreAttention` in its place:
softmax attention over the padded batch's mask, computed in float32, with the scale MLA hands it
(YaRN's mscale included). With Transformer Engine the layer specs are megatron-core's own.

megatron-core 0.16 also takes its Transformer Engine placeholders for the real classes when Transformer
Engine is missing (``multi_latent_attention.HAVE_TE``); :func:`allow_mla_without_te` corrects that flag
where Transformer Engine cannot be imported.
"""

from __future__ import annotations

import importlib.util

import torch


def allow_mla_without_te() -> None:
    """Where Transformer Engine is not installed, tell megatron-core's MLA module so (see the docstring)."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def with_latent_core_attention(spec) -> None:
    """Put :class:`LatentCoreAttention` in every MLA layer of ``spec`` (a TransformerBlockSubmodules, or one
    layer's ModuleSpec), in place."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attention = getattr(layer.submodules, "self_attention", None)
        if attention is not None and hasattr(attention.submodules, "linear_kv_down_proj"):
            attention.submodules.core_attention = LatentCoreAttention


class LatentCoreAttention(torch.nn.Module):
    """Softmax attention for MLA's [sequence, batch, heads, dim] queries, keys and values, whose key and value
    head sizes differ. Masks are megatron-core's: True hides a key (the padded batch's causal-and-padding mask;
    none: causal). Packed (thd) sequences need Transformer Engine."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or 1) ** -0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("multi-latent attention over packed (thd) sequences needs Transformer Engine")
        if attention_bias is not None:
            raise ValueError("multi-latent attention takes no attention bias")
        length, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, sequence, dim]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        if attention_mask is None:
            attention_mask = torch.ones(length, key.shape[0], dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        context = torch.matmul(probs, v)  # [batch, heads, sequence, value dim]
        return context.permute(2, 0, 1, 3).reshape(length, batch, -1)
