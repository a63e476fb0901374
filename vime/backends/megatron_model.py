"""Building a megatron-core GPTModel and moving weights in and out of it.

- :func:`init_parallel` sets up torch.distributed (a one-process group when the caller has none) and
  megatron-core's model-parallel state.
- :func:`build_gpt_model` builds the GPTModel of a :class:`ModelArgs` (Transformer Engine layers when
  they are usable on CUDA, megatron-core's own layers otherwise; MoE layers where the model has experts).
- :func:`load_canonical` / :func:`gather_canonical` copy the canonical (full, TP=1) state dict of
  ``megatron_convert`` into a tensor-parallel model and back.
- :class:`MegatronLM` wraps the model in the ``model(input_ids=..., attention_mask=...).logits``
  interface the shared training code calls, batching either packed (thd) or right-padded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
import warnings

import torch

from vime.backends.megatron_args import ModelArgs
from vime.backends.megatron_convert import from_te_names

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")

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
        moe_router_score_function="softmax",
        moe_layer_freq=args.moe_layer_pattern(),
        moe_router_dtype=moe.router_dtype,  # fp32 unless --moe-router-dtype fp64: HF routes in float32
        moe_router_load_balancing_type=moe.load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher_type,
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
        "moe_layer_freq",
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
        **(recompute or {}),
    )
    unlisted = set(fields) - VIME_TRANSFORMER_FIELDS
    assert not unlisted, f"VIME_TRANSFORMER_FIELDS misses {sorted(unlisted)}"
    clash = sorted(set(overrides or {}) & VIME_TRANSFORMER_FIELDS)
    if clash:
        raise ValueError(f"TransformerConfig fields {clash} are vime's to set, not a passed-through flag's")
    return TransformerConfig(**fields, **(overrides or {}))


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

    use_te = te_usable() if use_te is None else use_te
    if parallel.tensor > 1 or parallel.expert_tensor_size > 1:
        # megatron-core marks which tensors are split (tensor_model_parallel, partition_dim) only in its
        # initialisation code, and the gathers, shards and gradient norm here rely on those marks.
        config_kwargs["initialize"] = True
    config = transformer_config(args, parallel, use_te=use_te, **config_kwargs)
    if args.is_moe:
        # MoE and dense layers mixed as config.moe_layer_freq says; without Transformer Engine the experts
        # are megatron-core's SequentialMLP (one MLP per expert; no grouped GEMM, runs on CPU).
        _megatron_without_te()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
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
        rotary_base=int(args.rotary_base) if float(args.rotary_base).is_integer() else args.rotary_base,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
    )
    model.vime_uses_te = use_te
    model.vime_grouped_gemm = bool(config.moe_grouped_gemm)
    if args.is_moe:
        from vime.backends.megatron_routing import detach_from_global_replay

        detach_from_global_replay(model)
    return model.to(device())


# ---------------------------------------------------------------------------------------------- weights
def _tp():
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _ep():
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_group(),
    )


def _etp():
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_group(),
    )


def _tensor_split(canonical_name: str):
    """(rank, size, group) of the tensor parallelism that splits a tensor: a routed expert's is the
    expert tensor parallelism, every other tensor's the model's."""
    return _etp() if is_expert_param(canonical_name) else _tp()


_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def is_expert_param(name: str) -> bool:
    """A routed expert's tensor (held by one expert-parallel rank; a shared expert is not one)."""
    return ".mlp.experts." in name


def _expert_name(name: str, index: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{index}{m.group(3)}", name)


def _local_expert_index(name: str) -> int | None:
    match = _LOCAL_EXPERT.search(name)
    return None if match is None else int(match.group(2))


def _is_fc1(name: str) -> bool:
    """The fused [gate; up] projection of an MLP: dense, routed expert or shared expert."""
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _is_tied_copy(param) -> bool:
    """The last pipeline stage's copy of a tied input embedding (megatron-core marks it ``shared``)."""
    return getattr(param, "shared", False)


def _canonical_names(model) -> dict[str, str]:
    """Model parameter name -> canonical (local-spec) name, layers and experts numbered globally: a
    pipeline stage's layer i is layer ``first layer of the stage + i``, and under expert parallelism rank
    r's local expert i is expert ``r * local experts + i``. A last stage's copy of a tied embedding is the
    embedding."""
    from vime.backends.megatron_pipeline import stage_layers

    names = [n for n, _ in model.named_parameters()]
    canonical = dict(zip(names, from_te_names(dict.fromkeys(names)).keys()))
    offset = stage_layers(model).start
    if offset:
        canonical = {
            n: _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", c) for n, c in canonical.items()
        }
    for name, param in model.named_parameters():
        if _is_tied_copy(param):
            canonical[name] = VOCAB_PARAMS[0]
    ep_rank, ep_size, _ = _ep()
    if ep_size == 1:
        return canonical
    local = _local_experts(canonical.values())
    return {
        n: _expert_name(c, ep_rank * local + i) if (i := _local_expert_index(c)) is not None else c
        for n, c in canonical.items()
    }


def local_expert_count(model) -> int:
    """Routed experts per MoE layer held by this rank (0 for a dense model)."""
    names = [n for n, _ in model.named_parameters()]
    return _local_experts(from_te_names(dict.fromkeys(names)).keys())


def _local_experts(canonical_names) -> int:
    """Experts per MoE layer on this rank."""
    return 1 + max((i for c in canonical_names if (i := _local_expert_index(c)) is not None), default=-1)


def load_canonical(model, canonical: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Copy a canonical state dict into ``model`` (this rank's tensor-parallel shard of every tensor;
    the vocabulary padded with zero rows). Every parameter must be found and every tensor used."""
    names = _canonical_names(model)
    missing = [c for c in names.values() if c not in canonical]
    unused = set(canonical) - set(names.values())
    if _ep()[1] > 1:  # the other expert-parallel ranks' experts
        unused = {c for c in unused if _local_expert_index(c) is None}
    unused = {c for c in unused if _held_by_this_stage(c, model)}
    unused = sorted(unused)
    if missing or unused:
        raise ValueError(f"state dict does not fit the model: missing {missing[:6]}, unused {unused[:6]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = canonical[names[name]].to(torch.float32)
            rank, size, _ = _tensor_split(names[name])
            if names[name] in VOCAB_PARAMS:
                padded = param.shape[0] * (size if getattr(param, "tensor_model_parallel", False) else 1)
                full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
                if _is_fc1(names[name]) and args.swiglu:
                    gate, up = full.chunk(2, dim=0)
                    full = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
                else:
                    full = full.chunk(size, dim=dim)[rank]
            if full.shape != param.shape:
                raise ValueError(
                    f"{names[name]}: shape {tuple(full.shape)} does not fit the model's {tuple(param.shape)}"
                )
            param.copy_(full.to(param.device))


def _held_by_this_stage(canonical_name: str, model) -> bool:
    """Whether a canonical tensor belongs to this pipeline stage's slice of the model."""
    layer = _LAYER.match(canonical_name)
    if layer is not None:
        from vime.backends.megatron_pipeline import stage_layers

        return int(layer.group(1)) in stage_layers(model)
    if canonical_name.startswith("embedding."):
        return model.pre_process
    return model.post_process  # the final norm and the output layer


def gather_canonical(model, args: ModelArgs, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The canonical (full, unpadded) state dict of a tensor-, expert- or pipeline-parallel ``model``; every
    rank of those groups must call it (it gathers)."""
    import torch.distributed as dist

    names = _canonical_names(model)
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_tied_copy(param):
                continue  # the first stage holds the embedding
            tensor = param.detach()
            _, size, group = _tensor_split(names[name])
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                if _is_fc1(names[name]) and args.swiglu:
                    halves = [p.chunk(2, dim=0) for p in parts]
                    tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    tensor = torch.cat(parts, dim=param.partition_dim)
            if names[name] in VOCAB_PARAMS:
                tensor = tensor[: args.vocab_size]
            out[names[name]] = tensor.cpu() if to_cpu else tensor
    ep_rank, ep_size, ep_group = _ep()
    if ep_size > 1:
        out = _gather_experts(out, local_expert_count(model), ep_size, ep_group, to_cpu=to_cpu)
    return _gather_stages(out, to_cpu=to_cpu)


def _gather_stages(local: dict[str, torch.Tensor], *, to_cpu: bool) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors, in layer order (every rank of the pipeline group calls it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = ps.get_pipeline_model_parallel_world_size()
    if size == 1:
        return local
    stages = [None] * size
    dist.all_gather_object(
        stages, {name: tensor.cpu() for name, tensor in local.items()}, group=ps.get_pipeline_model_parallel_group()
    )
    here = device()
    return {name: tensor if to_cpu else tensor.to(here) for stage in stages for name, tensor in stage.items()}


def _gather_experts(
    local: dict[str, torch.Tensor], experts: int, ep_size: int, group, *, to_cpu: bool
) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's experts (``experts`` each, numbered globally in ``local``'s names), under
    their global names (every rank of the group calls it)."""
    import torch.distributed as dist

    out = {}
    for name, tensor in local.items():
        index = _local_expert_index(name)
        if index is None:
            out[name] = tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        local_index = index % experts
        for rank, part in enumerate(parts):
            out[_expert_name(name, rank * experts + local_index)] = part.cpu() if to_cpu else part
    return out


# ---------------------------------------------------------------------------------------------- forward
@dataclasses.dataclass
class CausalLMOutput:
    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None  # a pipeline stage before the last: the hidden states it passes on


class MegatronLM(torch.nn.Module):
    """``model(input_ids=[B, T], attention_mask=[B, T]).logits`` -> [B, T, vocab] over right-padded rows.

    ``packing='thd'`` concatenates the rows' real tokens into one varlen sequence (Transformer Engine
    attention, no padding computed); ``'padded'`` runs the padded batch with an explicit causal mask.
    Logits of padded positions are zero in thd mode (never used: the loss masks them). Logits of the
    padded vocabulary rows are dropped.

    ``routes`` (MoE, R3): per row, the recorded experts [positions, MoE layers, topk] of its first
    positions (``megatron_routing.sample_routes``); the forward routes those positions to them.
    Without ``routes`` the routers choose freely.

    Under pipeline parallelism (``pipeline``) a stage after the first takes its input from the previous
    stage, and a stage before the last returns its hidden states (``CausalLMOutput.hidden``) instead of logits.

    Under context parallelism (``context``, a ``megatron_context.ContextSplit``) the model runs over this
    rank's positions of each padded row, and the last stage gathers every rank's logits into whole rows.
    """

    def __init__(
        self,
        gpt,
        vocab_size: int,
        packing: str = "padded",
        sequence_parallel: bool = False,
        model_args: ModelArgs | None = None,
        pipeline=None,
        context=None,
    ):
        super().__init__()
        self.gpt = gpt
        self.vocab_size = vocab_size
        self.packing = packing
        self.sequence_parallel = sequence_parallel
        self.model_args = model_args
        self.pipeline = pipeline
        self.context = context  # padded rows only: ContextParallelAttention refuses packed sequences
        self._stage_moe_layers = self._moe_layers_of_stage()

    def _moe_layers_of_stage(self) -> list[int] | None:
        """Positions, among the model's MoE layers, of those this pipeline stage holds (None: all)."""
        if self.pipeline is None or self.model_args is None or not self.model_args.is_moe:
            return None
        from vime.backends.megatron_pipeline import stage_layers

        held = stage_layers(self.gpt)
        return [i for i, layer in enumerate(self.model_args.moe_layers) if layer in held]

    @property
    def _last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.last

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        routes: list[torch.Tensor] | None = None,
    ) -> CausalLMOutput:
        dev = device()
        input_ids = input_ids.to(dev)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(dev)
        if routes is not None:
            if self.model_args is None or not self.model_args.is_moe:
                raise ValueError("routes given for a model without MoE layers")
            if len(routes) != input_ids.shape[0]:
                raise ValueError(f"routes for {len(routes)} rows, the batch has {input_ids.shape[0]}")
        self._routes = routes
        if self.pipeline is not None and not self.pipeline.first:
            self.gpt.set_input_tensor(self.pipeline.receive_input(self.gpt.config.pipeline_dtype, dev))
        batch, length = input_ids.shape
        if self.packing == "thd":
            output = self._forward_thd(input_ids, attention_mask)
        else:
            input_ids, attention_mask = self._lockstep_padded(input_ids, attention_mask)
            output = self._forward_padded(input_ids, attention_mask)
        if not self._last_stage:
            return CausalLMOutput(logits=None, hidden=output)
        if self.packing != "thd":
            output = output[:batch, :length]
        return CausalLMOutput(output[..., : self.vocab_size].float())

    def _lockstep(self):
        """The group whose ranks exchange tokens inside every MoE layer (expert and expert tensor
        parallelism), or None. Its ranks must run each forward on the same number of tokens: megatron-core's
        all-gather dispatcher gathers equal slices."""
        if self.model_args is None or not self.model_args.is_moe:
            return None
        from megatron.core import parallel_state as ps

        if ps.get_expert_tensor_and_model_parallel_world_size() == 1:
            return None
        return ps.get_expert_tensor_and_model_parallel_group()

    def _agree(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the lockstep group."""
        import torch.distributed as dist

        shape = torch.tensor(values, dtype=torch.long, device=device())
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self._lockstep())
        return shape.tolist()

    def _lockstep_padded(self, input_ids, attention_mask):
        """Under expert parallelism, pad the batch to the group's largest [rows, length]. Padding rows keep
        their first position unmasked so that attention stays finite; their outputs are cut off."""
        batch, length = input_ids.shape
        self._real_rows = batch
        if self._lockstep() is None:
            return input_ids, attention_mask
        rows, columns = self._agree([batch, length])
        if (rows, columns) == (batch, length):
            return input_ids, attention_mask
        input_ids = torch.nn.functional.pad(input_ids, (0, columns - length, 0, rows - batch))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, columns - length, 0, rows - batch))
        attention_mask[batch:, 0] = 1
        if self._routes is not None:
            empty = self._routes[0].new_zeros((0, *self._routes[0].shape[1:]))
            self._routes = list(self._routes) + [empty] * (rows - batch)
        return input_ids, attention_mask

    def _padding(self, padding: torch.Tensor) -> dict:
        """MoE routers leave padded tokens (True) out of their load-balancing statistics."""
        return {"padding_mask": padding} if self.model_args is not None and self.model_args.is_moe else {}

    def _force(self, layout_fn) -> None:
        """Set (or clear) the routers' forced experts for the forward about to run; a dense model has none."""
        if self.model_args is None or not self.model_args.is_moe:
            return
        from vime.backends import megatron_routing as mr

        if self._routes is None:
            mr.force_routes(self.gpt, None)
            return
        rank, size, _ = _tp()
        layers = mr.per_layer(
            layout_fn(), tp_rank=rank, tp_size=size, sequence_parallel=self.sequence_parallel, device=device()
        )
        if self._stage_moe_layers is not None:
            layers = [layers[i] for i in self._stage_moe_layers]
        mr.force_routes(self.gpt, layers)

    def _tp_multiple(self) -> int:
        return _tp()[1] if self.sequence_parallel else 1

    def _forward_padded(self, input_ids, attention_mask):
        batch, length = input_ids.shape
        multiple = self._tp_multiple() * (1 if self.context is None else self.context.multiple)
        padded = -(-length // multiple) * multiple
        if padded != length:  # sequence and context parallelism split the sequence evenly over the ranks
            input_ids = torch.nn.functional.pad(input_ids, (0, padded - length))
            attention_mask = torch.nn.functional.pad(attention_mask, (0, padded - length))
        positions = torch.arange(padded, device=input_ids.device).unsqueeze(0).expand(batch, padded)
        # True = masked: later keys (causal) and padded keys.
        causal = torch.ones(padded, padded, dtype=torch.bool, device=input_ids.device).triu(1)
        mask = causal[None, None] | (attention_mask == 0)[:, None, None, :]
        from vime.backends.megatron_routing import padded_layout

        padding = attention_mask == 0
        padding[self._real_rows :] = True  # lockstep padding rows stay out of the routers' statistics
        held = slice(None)  # the positions this rank holds (on the CPU, as the routes are)
        if self.context is not None:  # this rank's positions (queries) against every rank's (keys)
            held = self.context.positions(padded)
            here = held.to(input_ids.device)
            keys = self.context.gathered_positions(padded, device=input_ids.device)
            mask = mask[:, :, here][..., keys]
            input_ids, positions, padding = input_ids[:, here], positions[:, here], padding[:, here]
        self._force(lambda: padded_layout(self._routes, padded, self.model_args)[:, held])
        output = self.gpt(input_ids, positions, mask, **self._padding(padding))
        if not self._last_stage:
            return output
        if self.context is not None:
            output = self.context.gather_sequence(output, dim=1)
        return output[:, :length]

    def _forward_thd(self, input_ids, attention_mask):
        from megatron.core.packed_seq_params import PackedSeqParams

        batch, length = input_ids.shape
        lengths = attention_mask.sum(dim=1).tolist()
        tokens = torch.cat([input_ids[row, :n] for row, n in enumerate(lengths)])
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
        total = tokens.numel()
        multiple = self._tp_multiple()
        extra = -(-total // multiple) * multiple - total
        if self._lockstep() is not None:  # as many tokens as the expert-parallel group's largest batch
            extra = self._agree([total + extra])[0] - total
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        if extra:  # padding joins the last sequence: causal attention keeps it out of the real tokens
            tokens = torch.nn.functional.pad(tokens, (0, extra))
            positions = torch.cat([positions, torch.arange(lengths[-1], lengths[-1] + extra, device=input_ids.device)])
            bounds[-1] += extra
        cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
        longest = max(lengths) + extra
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        from vime.backends.megatron_routing import packed_layout

        self._force(lambda: packed_layout(self._routes, lengths, total + extra, self.model_args))
        padding = torch.arange(total + extra, device=input_ids.device) >= total
        output = self.gpt(
            tokens.unsqueeze(0),
            positions.unsqueeze(0),
            None,
            packed_seq_params=params,
            **self._padding(padding.unsqueeze(0)),
        )
        if not self._last_stage:
            return output
        packed = output[0]
        rows = [
            torch.nn.functional.pad(packed[start : start + n], (0, 0, 0, length - n))
            for start, n in zip(bounds[:-1], lengths)
        ]
        return torch.stack(rows)
