"""Building a megatron-core GPTModel: the process groups, the TransformerConfig and the model.

- :func:`init_parallel` sets up torch.distributed (a one-process group when the caller has none) and
  megatron-core's model-parallel state.
- :func:`build_gpt_model` builds the GPTModel of a :class:`ModelArgs` (Transformer Engine layers when
  they are usable on CUDA, megatron-core's own layers otherwise; MoE layers where the model has experts).

Moving weights in and out of the model is ``megatron_weights``; running it behind the shared training
code's interface is ``megatron_forward``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import warnings

import torch

from vime.backends.megatron_args import ModelArgs
from vime.backends.megatron_linear_attention import linear_attention_config

# megatron-core 0.16 warns about missing Apex / Transformer Engine and deprecated defaults at every import
# and layer: noise for vime's users, who choose neither.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None  # tensor parallelism inside each expert (None: as ``tensor``)
    sequence_parallel: bool = False
    first_stage_layers: int | None = None  # decoder layers of the first / last pipeline stage (None: even split)
    last_stage_layers: int | None = None

    @property
    def expert_tensor_size(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeOptions:
    """How MoE layers train, beyond the architecture (``ModelArgs``): the MoE training flags."""

    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    token_dispatcher_type: str = "allgather"
    grouped_gemm: bool = False  # only with Transformer Engine (TEGroupedMLP)
    routing_replay: bool = False  # R3: routers accept forced top-k indices (megatron_routing)
    router_dtype: str = "fp32"  # --moe-router-dtype; fp32 by default, as HF's routers compute
    # An expert bias's step after each optimizer step: --moe-router-bias-update-rate with
    # --moe-router-enable-expert-bias, else 0 (the bias stays as loaded)
    bias_update_rate: float = 0.0


def deepep_usable() -> bool:
    """Whether megatron-core's flex dispatcher can run DeepEP's kernels here (the deep_ep package, CUDA)."""
    return torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None


def token_dispatcher(requested: str) -> str:
    """megatron-core's dispatcher for --moe-token-dispatcher-type: 'flex' (DeepEP's kernels) where DeepEP can
    run, else 'alltoall', which sends the same tokens to the same experts (only the kernels differ)."""
    if requested == "flex" and not deepep_usable():
        return "alltoall"
    return requested


def te_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def cuda_reachable() -> bool:
    """Whether megatron-core's hard-coded ``torch.cuda.current_device()`` works here (a GPU, or the
    tests' CPU shim)."""
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError):
        return False
    return True


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def tp_split():
    """(rank, size, group) of this rank's tensor parallelism."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(parallel: Parallelism, *, seed: int | None = None) -> None:
    """torch.distributed (a one-process group on 127.0.0.1 unless the caller set one up) and megatron-core's
    parallel state for ``parallel``. Idempotent; a different, already initialised layout is an error."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps, tensor_parallel

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
        )
    world = dist.get_world_size()
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    if world % model_parallel:
        raise ValueError(
            f"{world} process(es) cannot hold tensor x pipeline x context parallelism "
            f"{parallel.tensor} x {parallel.pipeline} x {parallel.context}"
        )
    if ps.model_parallel_is_initialized():
        now = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        if now != (parallel.tensor, parallel.pipeline, parallel.context):
            raise ValueError(
                f"megatron-core is already initialised with TP/PP/CP {now}, not "
                f"{(parallel.tensor, parallel.pipeline, parallel.context)}"
            )
    else:
        ps.initialize_model_parallel(
            parallel.tensor,
            parallel.pipeline,
            context_parallel_size=parallel.context,
            expert_model_parallel_size=parallel.expert,
            expert_tensor_parallel_size=parallel.expert_tensor_size,
        )
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _moe_config(args: ModelArgs, moe: MoeOptions, use_te: bool) -> dict:
    """TransformerConfig's MoE fields (none for a dense model)."""
    if not args.is_moe:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=moe.bias_update_rate,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_layer_freq=args.moe_layer_pattern(),
        moe_router_dtype=moe.router_dtype,  # fp32 unless --moe-router-dtype fp64: HF routes in float32
        moe_router_load_balancing_type=moe.load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=token_dispatcher(moe.token_dispatcher_type),
        moe_grouped_gemm=moe.grouped_gemm and use_te,
        moe_enable_routing_replay=moe.routing_replay,
    )


# The TransformerConfig fields vime decides (model shape from the flags and the HF config, parallelism, precision,
# fusions, MoE and recomputation); a Megatron-LM flag passed through may set any other (vime.config.megatron_lm).
VIME_TRANSFORMER_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "gated_linear_unit",
        "activation_func",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "rotary_interleaved",
        "normalization",
        "layernorm_epsilon",
        "hidden_dropout",
        "attention_dropout",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "sequence_parallel",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage",
        "params_dtype",
        "pipeline_dtype",
        "use_cpu_initialization",
        "perform_initialization",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "num_moe_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_router_pre_softmax",
        "moe_router_score_function",
        "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate",
        "moe_router_topk_scaling_factor",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_layer_freq",
        "multi_latent_attention",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "rope_type",
        "rotary_base",
        "rotary_percent",
        "rotary_scaling_factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "moe_router_dtype",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_token_dispatcher_type",
        "moe_grouped_gemm",
        "moe_enable_routing_replay",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "fp16",
        "bf16",
        "fp8",
        "fp4",  # vime trains in float32, or in bf16 with --bf16 (transformer_config sets it)
        "attention_output_gate",
        "experimental_attention_variant",
        "linear_attention_freq",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    }
)


def transformer_config(
    args: ModelArgs,
    parallel: Parallelism,
    *,
    attention_dropout: float = 0.0,
    hidden_dropout: float = 0.0,
    recompute: dict | None = None,
    initialize: bool = True,
    moe: MoeOptions | None = None,
    use_te: bool = False,
    overrides: dict | None = None,
    bf16: bool = False,
):
    """The model's TransformerConfig; ``overrides`` (Megatron-LM flags passed through) set fields vime leaves at
    megatron-core's defaults. ``bf16`` (--bf16): the layers compute in bfloat16 (softmax upcast as
    megatron-core does for bf16 inputs) and pipeline stages exchange bf16 activations; the parameters are still
    created in float32, so that the loaded weights are exact when the trainer takes its float32 masters from
    them and casts the model (vime/backends/precision.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        sequence_parallel=parallel.sequence_parallel,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor_size,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialize,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **_moe_config(args, moe or MoeOptions(), use_te),
        **linear_attention_config(args),
        **(recompute or {}),
    )
    config_class = TransformerConfig
    if args.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        fields.update(_mla_config(args))
    unlisted = set(fields) - VIME_TRANSFORMER_FIELDS
    assert not unlisted, f"VIME_TRANSFORMER_FIELDS misses {sorted(unlisted)}"
    clash = sorted(set(overrides or {}) & VIME_TRANSFORMER_FIELDS)
    if clash:
        raise ValueError(f"TransformerConfig fields {clash} are vime's to set, not a passed-through flag's")
    return config_class(**fields, **(overrides or {}))


def _mla_config(args: ModelArgs) -> dict:
    """MLATransformerConfig's fields: the latent ranks, the head sizes and the RoPE (YaRN where config.json
    scales it; MLA applies RoPE itself, so the GPT's own rotary embedding is off)."""
    yarn = args.yarn_fields()
    if yarn:  # a context length: megatron-core takes an int
        yarn["original_max_position_embeddings"] = int(yarn["original_max_position_embeddings"])
    return dict(
        multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        **yarn,
    )


def _megatron_without_te() -> None:
    """megatron-core 0.16.1's router gating tests ``te_general_gemm is not None`` but defines the name only
    when Transformer Engine imports; without it, define it as absent (the plain matmul path then runs)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(
    args: ModelArgs,
    parallel: Parallelism,
    *,
    vocab_divisible_by: int = 128,
    use_te: bool | None = None,
    **config_kwargs,
):
    """The GPTModel of ``args`` on this process's device (full logits: ``parallel_output=False``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # (Transformer Engine specs of the hybrid layers are not built: its fused norms would rename their weights)
    use_te = (te_usable() and not args.is_hybrid) if use_te is None else use_te
    if use_te and args.is_hybrid:
        raise ValueError(f"{args.family}'s gated delta-net layers are built without Transformer Engine")
    if parallel.tensor > 1 or parallel.expert_tensor_size > 1:
        # megatron-core marks which tensors are split (tensor_model_parallel, partition_dim) only in its
        # initialisation code, and the gathers, shards and gradient norm here rely on those marks.
        config_kwargs["initialize"] = True
    config = transformer_config(args, parallel, use_te=use_te, **config_kwargs)
    if args.multi_latent_attention:
        from vime.backends.megatron_mla import allow_mla_without_te

        allow_mla_without_te()
    if args.is_hybrid:
        from vime.backends.megatron_linear_attention import allow_gated_delta_net_without_fla, hybrid_block_spec

        allow_gated_delta_net_without_fla()
        if args.is_moe:
            _megatron_without_te()
        spec = hybrid_block_spec(config, args)
    elif args.is_moe:
        # MoE and dense layers mixed as config.moe_layer_freq says; without Transformer Engine the experts
        # are megatron-core's SequentialMLP (one MLP per expert; no grouped GEMM, runs on CPU).
        _megatron_without_te()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization)
        if args.multi_latent_attention and not use_te:
            from vime.backends.megatron_mla import with_latent_core_attention

            with_latent_core_attention(spec)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    if args.qk_norm_over_heads:
        from vime.backends.megatron_layers import with_query_key_norms_over_heads

        spec = with_query_key_norms_over_heads(spec)
    if args.post_sublayer_norms:
        from vime.backends.megatron_layers import with_post_sublayer_norms

        spec = with_post_sublayer_norms(spec, use_te=use_te)
    if parallel.sequence_parallel and not use_te:
        from vime.backends.megatron_layers import with_sequence_parallel_norms

        spec = with_sequence_parallel_norms(spec, config)
    if parallel.context > 1:
        from vime.backends.megatron_context import with_context_parallel_attention

        spec = with_context_parallel_attention(spec)
    from megatron.core import parallel_state as ps

    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        vocab_size=args.padded_vocab_size(vocab_divisible_by, parallel.tensor),
        max_sequence_length=args.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=args.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base) if float(args.rotary_base).is_integer() else args.rotary_base,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
    )
    model.vime_uses_te = use_te
    model.vime_grouped_gemm = bool(config.moe_grouped_gemm)
    if args.is_moe:
        from vime.backends.megatron_routing import detach_from_global_replay

        detach_from_global_replay(model)
    if args.moe_router_enable_expert_bias:
        from vime.backends.megatron_expert_bias import count_loads

        count_loads(model)
    return model.to(device())
