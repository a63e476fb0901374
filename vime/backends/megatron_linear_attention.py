"""Qwen3-Next's and Qwen3.5's hybrid decoder in megatron-core: gated delta-net layers (linear attention, megatron-core's
``GatedDeltaNet``) between softmax-attention layers whose output is gated, from megatron-core's own modules.

megatron-core 0.16.1 builds such a decoder from Transformer Engine specs only (its experimental-attention block
spec asserts Transformer Engine). :func:`hybrid_block_spec` builds the same block from the local specs: each layer
is megatron-core's ``TransformerLayer`` (dense or MoE as ``config.moe_layer_freq`` says), its ``self_attention`` a
``GatedDeltaNet`` where ``ModelArgs.linear_attention_layers`` says, with :class:`ZeroCenteredRMSNorm` for every norm
of a model that has them (the delta net's gated output norm excepted: HF's is a plain weight).

What the layer takes: right-padded micro-batches only (``GatedDeltaNet`` refuses packed sequences; a row's padding
comes after its tokens, so the recurrence never carries it into them), tensor and context parallelism 1
(``vime.backends.megatron_setup.check_linear_attention``).

``GatedDeltaNet`` refuses to build without flash-linear-attention (fla), whose l2norm and chunked delta-rule kernels
it calls. megatron-core carries a torch version of that rule (its deterministic mode's, a port of HF's); where fla
is not installed (this CPU machine, or a GPU without it), :func:`allow_gated_delta_net_without_fla` makes the layer
use it and a torch l2norm: HF's torch computation, slower than fla's kernels.
"""

from __future__ import annotations

import dataclasses

import torch

from vime.backends.megatron_args import ModelArgs
from vime.backends.megatron_layers import ZeroCenteredRMSNorm


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps) over ``dim`` (in float32, cast back)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def allow_gated_delta_net_without_fla() -> None:
    """Without fla, let ``GatedDeltaNet`` build and run on megatron-core's torch delta rule and a torch l2norm
    (idempotent; nothing changes where fla is installed)."""
    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA:
        return
    gated_delta_net.l2norm = _l2norm
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True


def _gated_delta_net_spec():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        ),
    )


def _hybrid_layer(spec, *, linear: bool, zero_centered: bool):
    """One layer's spec: its attention a gated delta net when ``linear``, its norms zero-centred when asked."""
    layer = spec.submodules
    changes = {}
    if zero_centered:
        changes.update(input_layernorm=ZeroCenteredRMSNorm, pre_mlp_layernorm=ZeroCenteredRMSNorm)
    if linear:
        changes["self_attention"] = _gated_delta_net_spec()
    elif zero_centered:
        attention = layer.self_attention
        query_key_norms = dict(q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm)
        changes["self_attention"] = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, **query_key_norms)
        )
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, **changes))


def hybrid_block_spec(config, args: ModelArgs):
    """The decoder block spec (``TransformerBlockSubmodules``) of this pipeline stage's layers of a hybrid model."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if args.is_moe:
        layers = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization)
    else:
        layers = [get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)]
        layers *= args.num_layers
    specs = [
        _hybrid_layer(spec, linear=i in args.linear_attention_layers, zero_centered=args.zero_centered_norms)
        for i, spec in enumerate(layers)
    ]
    offset = get_transformer_layer_offset(config)
    stage = specs[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(
        layer_specs=stage, layer_norm=ZeroCenteredRMSNorm if args.zero_centered_norms else WrappedTorchNorm
    )


def linear_attention_config(args: ModelArgs) -> dict:
    """TransformerConfig's fields of the gated delta-net layers and the gated attention (none for other models)."""
    fields = {"attention_output_gate": True} if args.attention_output_gate else {}
    if args.is_hybrid:
        fields.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=args.linear_attention_pattern(),
            linear_conv_kernel_dim=args.linear_conv_kernel_dim,
            linear_key_head_dim=args.linear_key_head_dim,
            linear_value_head_dim=args.linear_value_head_dim,
            linear_num_key_heads=args.linear_num_key_heads,
            linear_num_value_heads=args.linear_num_value_heads,
        )
    return fields
