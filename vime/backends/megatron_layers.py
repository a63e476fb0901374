"""Norm layers megatron-core's layer specs do not have on their own.

- MiniMax-M2's query and key norms over the whole projection (:func:`with_query_key_norms_over_heads`).
- Qwen3-Next's zero-centred RMSNorms, ``x_normed * (1 + weight)`` (:class:`ZeroCenteredRMSNorm`): megatron-core's
  torch norms refuse ``layernorm_zero_centered_gamma``, and folding the one into the weight would make the
  round trip to HF inexact.
- GLM-4's norms on the attention's and the MLP's outputs, before each residual add
  (:func:`with_post_sublayer_norms`).
- Norms for megatron-core's own (non-Transformer-Engine) layer specs under sequence parallelism: megatron-core's
  torch norms (``WrappedTorchNorm``) refuse ``--sequence-parallel``: under it each tensor-parallel
rank normalises a slice of the sequence, so the norms' weights get only part of their gradient on each
rank, and nothing in a plain torch norm marks them for summing. :class:`SequenceParallelTorchNorm` marks
them (``param.sequence_parallel``, as Transformer Engine's norms do) and the Megatron backend sums those
gradients over the tensor-parallel ranks. :func:`with_sequence_parallel_norms` puts it in a layer spec.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


class SequenceParallelTorchNorm:
    """torch's ``LayerNorm`` or ``RMSNorm`` (``config.normalization``) whose weights carry
    ``sequence_parallel`` = ``config.sequence_parallel``. The signature is megatron-core's norm interface."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--normalization {config.normalization}: expected one of {', '.join(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is an offset from one: ``rms_normed(x) * (1 + weight)``, computed in float32 and cast
    back as HF's Qwen3-Next does (Megatron-LM's ``--apply-layernorm-1p``). The signature is megatron-core's norm
    interface; the weight carries ``sequence_parallel`` as :class:`SequenceParallelTorchNorm`'s do."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"--apply-layernorm-1p is built for RMSNorm here, not --normalization {config.normalization}"
            )
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _NormOverHeads(torch.nn.Module):
    """RMSNorm over each token's whole query (or key) projection, every head at once (MiniMax-M2's q_norm and
    k_norm), in megatron-core's per-head norm slot: it takes ``[..., heads, head_dim]`` and returns that shape.
    HF's arithmetic: float32 statistics, the weight applied to the normalised input cast back. Built for tensor
    parallelism 1 (over split heads the statistics would need a sum over ranks)."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = x.flatten(-2).float()
        normed = whole * torch.rsqrt(whole.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)


class QueryNormOverHeads(_NormOverHeads):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        super().__init__(config.num_attention_heads, hidden_size, eps)


class KeyNormOverHeads(_NormOverHeads):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        super().__init__(config.num_query_groups, hidden_size, eps)


def with_query_key_norms_over_heads(spec):
    """A decoder block spec (``TransformerBlockSubmodules``) whose layers norm queries and keys over all heads at
    once (:class:`QueryNormOverHeads`, :class:`KeyNormOverHeads`)."""
    layers = []
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention
        norms = dict(q_layernorm=QueryNormOverHeads, k_layernorm=KeyNormOverHeads)
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **norms))
        layers.append(
            dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))
        )
    return dataclasses.replace(spec, layer_specs=layers)


def with_sequence_parallel_norms(spec, config):
    """A decoder block spec (``TransformerBlockSubmodules``; a single layer's spec is repeated for the layers
    this pipeline stage builds) with every torch norm, the final one included, made a
    :class:`SequenceParallelTorchNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if not isinstance(spec, TransformerBlockSubmodules):
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=WrappedTorchNorm
        )
    return _replaced(spec, WrappedTorchNorm, SequenceParallelTorchNorm, {})


def _replaced(node, old, new, seen: dict):
    """``node`` with every reference to ``old`` replaced by ``new`` (specs are dataclasses and lists; shared
    sub-specs stay shared)."""
    if node is old:
        return new
    if id(node) in seen:
        return seen[id(node)]
    if isinstance(node, list):
        out = [_replaced(item, old, new, seen) for item in node]
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = dataclasses.replace(
            node,
            **{f.name: _replaced(getattr(node, f.name), old, new, seen) for f in dataclasses.fields(node) if f.init},
        )
    else:
        return node
    seen[id(node)] = out
    return out


def _norm_the_output(norm):
    """A forward hook for a module returning ``(output, bias)`` (megatron-core's attention and MLP): ``(norm(output +
    bias), None)``. GLM-4's output projections have no bias; one would be added before the norm."""

    def hook(_module, _inputs, result):
        output, bias = result
        return norm(output if bias is None else output + bias), None

    return hook


@functools.cache
def _post_normed_layer() -> type:
    """megatron-core's TransformerLayer with GLM-4's ``post_self_attn_layernorm`` and ``post_mlp_layernorm``: the
    attention's and the MLP's outputs are normed before the layer adds them to its residual. The attention and MLP
    stay megatron-core's own modules (the layer gives them its process groups by their type)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class PostNormedTransformerLayer(TransformerLayer):
        def __init__(self, config, *args, post_norm: type, **kwargs):
            super().__init__(config, *args, **kwargs)
            size, eps = config.hidden_size, config.layernorm_epsilon
            self.post_self_attn_layernorm = post_norm(config=config, hidden_size=size, eps=eps)
            self.post_mlp_layernorm = post_norm(config=config, hidden_size=size, eps=eps)
            self.self_attention.register_forward_hook(_norm_the_output(self.post_self_attn_layernorm))
            self.mlp.register_forward_hook(_norm_the_output(self.post_mlp_layernorm))

    return PostNormedTransformerLayer


def with_post_sublayer_norms(spec, *, use_te: bool):
    """A dense layer's spec (``ModuleSpec`` of a TransformerLayer) whose attention and MLP each norm their output
    (GLM-4). The norm is Transformer Engine's with ``use_te``, else :class:`SequenceParallelTorchNorm` (plain torch
    without sequence parallelism)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if spec.module is not TransformerLayer:
        raise ValueError(f"GLM-4's post-sublayer norms need megatron-core's TransformerLayer, not {spec.module}")
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    else:
        norm = SequenceParallelTorchNorm
    return dataclasses.replace(spec, module=_post_normed_layer(), params={**spec.params, "post_norm": norm})
