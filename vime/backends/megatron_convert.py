"""HF <-> megatron-core weight naming for Qwen2 / Qwen3 / Llama / GLM-4 and the MoE Qwen3-MoE / Qwen2-MoE / Mixtral
(pure tensor code, no megatron import).

The *canonical* Megatron state dict is the full (tensor-parallel size 1) one with megatron-core's local
layer-spec names and the unpadded vocabulary::

    embedding.word_embeddings.weight                       <- model.embed_tokens.weight
    decoder.layers.N.input_layernorm.weight                <- model.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv.weight/bias <- q_proj, k_proj, v_proj (fused per query group)
    decoder.layers.N.self_attention.q_layernorm.weight     <- self_attn.q_norm.weight (Qwen3)
    decoder.layers.N.self_attention.k_layernorm.weight     <- self_attn.k_norm.weight (Qwen3)
    decoder.layers.N.self_attention.linear_proj.weight     <- self_attn.o_proj.weight
    decoder.layers.N.pre_mlp_layernorm.weight              <- post_attention_layernorm.weight
    decoder.layers.N.mlp.linear_fc1.weight                 <- [gate_proj; up_proj] (SwiGLU)
    decoder.layers.N.mlp.linear_fc2.weight                 <- mlp.down_proj.weight
    decoder.final_layernorm.weight                         <- model.norm.weight
    output_layer.weight                                    <- lm_head.weight (untied models only)

An MoE layer (``ModelArgs.moe_layers``) has instead of ``mlp.linear_fc1/2`` (HF ``mlp.`` for Qwen*-MoE,
``block_sparse_moe.`` for Mixtral, whose experts name gate/down/up ``w1``/``w2``/``w3``)::

    decoder.layers.N.mlp.router.weight                                <- mlp.gate.weight [experts, hidden]
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight    <- [experts.E.gate_proj; experts.E.up_proj]
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight    <- experts.E.down_proj
    decoder.layers.N.mlp.shared_experts.linear_fc1.weight             <- [shared_expert.gate_proj; up_proj] (Qwen2-MoE)
    decoder.layers.N.mlp.shared_experts.linear_fc2.weight             <- shared_expert.down_proj
    decoder.layers.N.mlp.shared_experts.gate_weight                   <- shared_expert_gate.weight [1, hidden]

GLM-4 (``glm4``, dense) fuses the MLP's gate and up projections as Megatron does, and norms the outputs of the
attention and of the MLP before their residual adds (``ModelArgs.post_sublayer_norms``)::

    decoder.layers.N.mlp.linear_fc1.weight                 <- mlp.gate_up_proj.weight ([gate; up] already)
    decoder.layers.N.post_self_attn_layernorm.weight       <- post_self_attn_layernorm.weight
    decoder.layers.N.post_mlp_layernorm.weight             <- post_mlp_layernorm.weight

GLM-4.5 (``glm4_moe``) names its shared experts ``mlp.shared_experts.`` (no gate) and adds the router's bias::

    decoder.layers.N.mlp.router.expert_bias                           <- mlp.gate.e_score_correction_bias [experts]

DeepSeek-V3 (``deepseek_v3``, also Moonlight) routes and names its experts as GLM-4.5 does; its
multi-latent attention maps one to one (megatron-core's MLA keeps HF's per-head layouts)::

    decoder.layers.N.self_attention.linear_q_down_proj.weight  <- self_attn.q_a_proj.weight
    decoder.layers.N.self_attention.q_layernorm.weight         <- self_attn.q_a_layernorm.weight
    decoder.layers.N.self_attention.linear_q_up_proj.weight    <- self_attn.q_b_proj.weight
    decoder.layers.N.self_attention.linear_q_proj.weight       <- self_attn.q_proj.weight (no q_lora_rank)
    decoder.layers.N.self_attention.linear_kv_down_proj.weight <- self_attn.kv_a_proj_with_mqa.weight
    decoder.layers.N.self_attention.kv_layernorm.weight        <- self_attn.kv_a_layernorm.weight
    decoder.layers.N.self_attention.linear_kv_up_proj.weight   <- self_attn.kv_b_proj.weight
    decoder.layers.N.self_attention.linear_proj.weight         <- self_attn.o_proj.weight

Qwen3-Next (``qwen3_next``) and Qwen3.5's language models (``qwen3_5_text``, ``qwen3_5_moe_text``) route and
name their experts as Qwen2-MoE does. Their softmax-attention layers gate their output: HF's ``q_proj`` holds each
head's query and then its gate, megatron-core's ``linear_qkv`` each query group's queries, then their gates, then
its key and value (:func:`fuse_gated_qkv`). Their other layers are gated delta nets::

    decoder.layers.N.self_attention.in_proj.weight         <- linear_attn.in_proj_qkvz, in_proj_ba (regrouped)
                                                              or in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    decoder.layers.N.self_attention.conv1d.weight          <- linear_attn.conv1d.weight
    decoder.layers.N.self_attention.dt_bias                <- linear_attn.dt_bias
    decoder.layers.N.self_attention.A_log                  <- linear_attn.A_log
    decoder.layers.N.self_attention.out_norm.weight        <- linear_attn.norm.weight
    decoder.layers.N.self_attention.out_proj.weight        <- linear_attn.out_proj.weight

Qwen3-Next's HF checkpoints group the delta net's input projections by key head (for each: its query, key, values
and output gates, and its beta and alpha rows), megatron-core by kind (all queries, keys, values, gates, betas,
alphas: :func:`fuse_gated_delta_net_projection`); Qwen3.5's keep four projections already grouped by kind
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), which ``in_proj`` concatenates. The zero-centred
norms' weights map unchanged (the Megatron model computes ``1 + weight`` as HF does). The checkpoints'
multi-token-prediction weights (``mtp.*``) are not in the Megatron model, as HF's model ignores them, and exports
carry them unchanged; so does a vision-language checkpoint's vision tower (Qwen3.5's: the language model's tensors
are then under ``model.language_model.``, ``ModelArgs.hf_prefix``).

MiniMax-M2 (``minimax_m2``) names its experts as Mixtral does (``block_sparse_moe.experts.E.w1/w3/w2``), its
expert bias ``block_sparse_moe.e_score_correction_bias``, and its query and key norms' weights cover every head
(``q_norm.weight`` [heads x head_dim]), as megatron-core's norms over the whole projection hold them.

In Transformer Engine specs the latents' norms fold into the up projections (``layer_norm_weight``) and the
input norm stays its own module. GLM-4.5's and DeepSeek-V3's checkpoints also hold the multi-token-prediction
layers after the last decoder layer (``num_nextn_predict_layers``), which HF's model ignores as well: the Megatron
model leaves them out, and exports carry them unchanged (:func:`untrained_hf_tensors`).

Megatron fuses Q, K and V group by group: for each of the ``num_query_groups`` key/value heads, the
rows of its ``heads / groups`` query heads, then its key head, then its value head. Transformer
Engine layer specs fold the two pre-norms into the following linear layer
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``; an MoE layer keeps its separate
``pre_mlp_layernorm``), and Transformer Engine's grouped experts (``--moe-grouped-gemm``) are
``mlp.experts.linear_fc1.weightE``: :func:`from_te_names` and :func:`to_te_names` translate.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch

from vime.backends.megatron_args import HYBRID_FAMILIES, MTP_FAMILIES, SIGMOID_ROUTED, ModelArgs

_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    # multi-latent attention: the latents' norms fold into the up projections (its input norm stays apart)
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"
)
_GROUPED_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")


def to_te_names(state: dict[str, torch.Tensor], *, grouped_gemm: bool = False) -> dict[str, torch.Tensor]:
    """Canonical names -> a Transformer Engine model's (``grouped_gemm``: TE's grouped experts)."""
    dense = {m.group(1) for m in map(_LAYER.match, state) if m and m.group(2) == "mlp.linear_fc1.weight"}
    mla = {m.group(1) for m in map(_LAYER.match, state) if m and m.group(2).startswith("self_attention.linear_kv_")}
    out = {}
    for name, value in state.items():
        m = _LAYER.match(name)
        folded = m and m.group(2) in _TE_NAMES
        if folded and m.group(2) == "pre_mlp_layernorm.weight":
            folded = m.group(1) in dense  # an MoE layer's pre-MLP norm is its own module
        elif folded and m.group(2) == "input_layernorm.weight":
            folded = m.group(1) not in mla  # MLA's input norm is its own module
        elif folded and m.group(2).startswith(("self_attention.q_layernorm", "self_attention.kv_layernorm")):
            folded = m.group(1) in mla  # (a Qwen3 query norm is its own module)
        if folded:
            name = f"decoder.layers.{m.group(1)}.{_TE_NAMES[m.group(2)]}"
        elif grouped_gemm and (e := _SEQUENTIAL_EXPERT.match(name)):
            name = f"{e.group(1)}.{e.group(3)}.weight{e.group(2)}"
        out[name] = value
    return out


def from_te_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    back = {v: k for k, v in _TE_NAMES.items()}
    out = {}
    for name, value in state.items():
        m = _LAYER.match(name)
        if m and m.group(2) in back:
            name = f"decoder.layers.{m.group(1)}.{back[m.group(2)]}"
        elif e := _GROUPED_EXPERT.match(name):
            name = f"{e.group(1)}.local_experts.{e.group(3)}.{e.group(2)}.weight"
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------- QKV
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) -> Megatron's fused per-group layout."""
    groups, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // groups
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], dim=1
    )
    return fused.reshape(groups * (per_group + 2) * d, *tail)


def split_qkv(fused: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // groups
    tail = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return (
        q.reshape(groups * per_group * d, *tail).contiguous(),
        k.reshape(groups * d, *tail).contiguous(),
        v.reshape(groups * d, *tail).contiguous(),
    )


def fuse_gated_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF's gated-attention projections (``q_proj``: each head's query rows, then its gate rows) -> megatron-core's
    ``linear_qkv`` with ``attention_output_gate``: per query group, its heads' queries, their gates, its key, its
    value."""
    groups, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // groups
    tail = q.shape[1:]
    heads = q.reshape(groups, per_group, 2, d, *tail)
    query, gate = (
        heads[:, :, 0].reshape(groups, per_group * d, *tail),
        heads[:, :, 1].reshape(groups, per_group * d, *tail),
    )
    fused = torch.cat([query, gate, k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], dim=1)
    return fused.reshape(groups * 2 * (per_group + 1) * d, *tail)


def split_gated_qkv(fused: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_gated_qkv`: HF's (q_proj, k_proj, v_proj)."""
    groups, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // groups
    tail = fused.shape[1:]
    query, gate, k, v = fused.reshape(groups, 2 * (per_group + 1) * d, *tail).split(
        [per_group * d, per_group * d, d, d], dim=1
    )
    heads = torch.stack([query.reshape(groups, per_group, d, *tail), gate.reshape(groups, per_group, d, *tail)], dim=2)
    return (
        heads.reshape(groups * per_group * 2 * d, *tail).contiguous(),
        k.reshape(groups * d, *tail).contiguous(),
        v.reshape(groups * d, *tail).contiguous(),
    )


def _delta_net_sizes(args: ModelArgs) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key head dim, value head dim) of a gated delta net."""
    key_heads = args.linear_num_key_heads
    return key_heads, args.linear_num_value_heads // key_heads, args.linear_key_head_dim, args.linear_value_head_dim


def fuse_gated_delta_net_projection(qkvz: torch.Tensor, ba: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF's ``in_proj_qkvz`` and ``in_proj_ba`` (grouped by key head: its query, key, r values and r output gates;
    its r betas and r alphas) -> megatron-core's ``in_proj`` (grouped by kind: queries, keys, values, gates, betas,
    alphas)."""
    key_heads, r, dk, dv = _delta_net_sizes(args)
    hidden = qkvz.shape[-1]
    q, k, v, z = qkvz.reshape(key_heads, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(key_heads, 2 * r, hidden).split([r, r], dim=1)
    return torch.cat([part.reshape(-1, hidden) for part in (q, k, v, z, b, a)], dim=0)


# Qwen3.5's delta nets keep HF's four input projections apart, each already grouped by kind: (HF name after
# ``linear_attn.``) in megatron-core's order within ``in_proj``
_SEPARATE_PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def _delta_net_in_proj(take, delta: str, args: ModelArgs) -> torch.Tensor:
    """megatron-core's ``in_proj`` from an HF delta net's input projections (``take``: HF name -> tensor)."""
    if args.family == "qwen3_next":
        return fuse_gated_delta_net_projection(
            take(delta + "in_proj_qkvz.weight"), take(delta + "in_proj_ba.weight"), args
        )
    return torch.cat([take(delta + name) for name in _SEPARATE_PROJECTIONS], dim=0)


def _delta_net_hf_projections(in_proj: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """(HF name after ``linear_attn.``, tensor) of megatron-core's ``in_proj``."""
    if args.family == "qwen3_next":
        qkvz, ba = split_gated_delta_net_projection(in_proj, args)
        return [("in_proj_qkvz.weight", qkvz), ("in_proj_ba.weight", ba)]
    key_heads, r, dk, dv = _delta_net_sizes(args)
    values = key_heads * r
    parts = in_proj.split([2 * key_heads * dk + values * dv, values * dv, values, values], dim=0)
    return [(name, part.contiguous()) for name, part in zip(_SEPARATE_PROJECTIONS, parts)]


def split_gated_delta_net_projection(in_proj: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_gated_delta_net_projection`: HF's (in_proj_qkvz, in_proj_ba)."""
    key_heads, r, dk, dv = _delta_net_sizes(args)
    hidden = in_proj.shape[-1]
    sizes = [key_heads * dk, key_heads * dk, key_heads * r * dv, key_heads * r * dv, key_heads * r, key_heads * r]
    q, k, v, z, b, a = (part.reshape(key_heads, -1, hidden) for part in in_proj.split(sizes, dim=0))
    qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, hidden).contiguous()
    return qkvz, torch.cat([b, a], dim=1).reshape(-1, hidden).contiguous()


# The gated delta net's tensors that map one to one: (Megatron suffix after ``decoder.layers.N.``, HF after
# ``model.layers.N.linear_attn.``)
_DELTA_NET_NAMES = [
    ("self_attention.conv1d.weight", "conv1d.weight"),
    ("self_attention.dt_bias", "dt_bias"),
    ("self_attention.A_log", "A_log"),
    ("self_attention.out_norm.weight", "norm.weight"),
    ("self_attention.out_proj.weight", "out_proj.weight"),
]


# ---------------------------------------------------------------------------------------------- MLA
def _mla_names(args: ModelArgs) -> list[tuple[str, str]]:
    """(Megatron suffix after ``decoder.layers.N.``, HF name after ``self_attn.``) of a multi-latent attention,
    the output projection excepted (which every attention has)."""
    if args.q_lora_rank:
        query = [
            ("self_attention.linear_q_down_proj.weight", "q_a_proj.weight"),
            ("self_attention.q_layernorm.weight", "q_a_layernorm.weight"),
            ("self_attention.linear_q_up_proj.weight", "q_b_proj.weight"),
        ]
    else:
        query = [("self_attention.linear_q_proj.weight", "q_proj.weight")]
    return query + [
        ("self_attention.linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
        ("self_attention.kv_layernorm.weight", "kv_a_layernorm.weight"),
        ("self_attention.linear_kv_up_proj.weight", "kv_b_proj.weight"),
    ]


# ---------------------------------------------------------------------------------------------- MLPs
def _mlp_names(args: ModelArgs, layer: int) -> list[tuple[str, str | tuple[str, str]]]:
    """(Megatron suffix after ``decoder.layers.N.``, HF name after ``model.layers.N.``) of one layer's MLP;
    a fused ``linear_fc1`` maps to the HF (gate, up) pair."""
    if not args.is_moe or layer not in args.moe_layers:
        fc1 = "mlp.gate_up_proj.weight" if args.family == "glm4" else ("mlp.gate_proj.weight", "mlp.up_proj.weight")
        return [("mlp.linear_fc1.weight", fc1), ("mlp.linear_fc2.weight", "mlp.down_proj.weight")]
    if args.family in ("mixtral", "minimax_m2"):
        block, gate, up, down = "block_sparse_moe.", "w1", "w3", "w2"
    else:
        block, gate, up, down = "mlp.", "gate_proj", "up_proj", "down_proj"
    names: list[tuple[str, str | tuple[str, str]]] = [("mlp.router.weight", block + "gate.weight")]
    if args.moe_router_enable_expert_bias:
        # (MiniMax-M2 keeps its bias beside the router, not in it)
        bias = "e_score_correction_bias" if args.family == "minimax_m2" else "gate.e_score_correction_bias"
        names.append(("mlp.router.expert_bias", block + bias))
    for e in range(args.num_experts):
        expert = f"{block}experts.{e}."
        names.append(
            (f"mlp.experts.local_experts.{e}.linear_fc1.weight", (f"{expert}{gate}.weight", f"{expert}{up}.weight"))
        )
        names.append((f"mlp.experts.local_experts.{e}.linear_fc2.weight", f"{expert}{down}.weight"))
    if args.moe_shared_expert_intermediate_size:
        shared = "mlp.shared_experts." if args.family in SIGMOID_ROUTED else "mlp.shared_expert."
        names += [
            ("mlp.shared_experts.linear_fc1.weight", (f"{shared}gate_proj.weight", f"{shared}up_proj.weight")),
            ("mlp.shared_experts.linear_fc2.weight", f"{shared}down_proj.weight"),
        ]
        if args.moe_shared_expert_gate:
            names.append(("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"))
    return names


def _post_norm_names(args: ModelArgs) -> list[tuple[str, str]]:
    """(Megatron suffix after ``decoder.layers.N.``, HF name after ``model.layers.N.``) of GLM-4's post-sublayer
    norms; none for the other families."""
    if not args.post_sublayer_norms:
        return []
    return [(f"{name}.weight", f"{name}.weight") for name in ("post_self_attn_layernorm", "post_mlp_layernorm")]


# ---------------------------------------------------------------------------------------------- HF -> Megatron
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def outside_language_model(hf_name: str, args: ModelArgs) -> bool:
    """A vision-language checkpoint's tensor that is not its language model's (the vision tower, its merger)."""
    return args.hf_prefix != "model." and not hf_name.startswith((args.hf_prefix, args.hf_head, "mtp."))


def untrained_hf_tensors(folder: str, args: ModelArgs, *, mtp_layers: bool) -> dict[str, torch.Tensor]:
    """The tensors of the HF checkpoint in ``folder`` that the Megatron model does not hold, read alone from its
    safetensors (their headers list the names): a vision-language checkpoint's vision tower and, with
    ``mtp_layers``, the multi-token-prediction layers (GLM-4.5's, DeepSeek-V3's, Qwen3-Next's). They are not
    trained; what vime exports carries them unchanged (the weights published at each step carry the vision tower,
    the final and checkpoint exports the MTP layers too: a whole checkpoint, which an engine with MTP speculative
    decoding loads; DeepSeek-V3's MTP layer is an MoE layer of its own, too large to rewrite at every step)."""
    from safetensors import safe_open

    if args.hf_prefix == "model." and not mtp_layers:
        return {}  # (no vision tower: nothing to read; the case of every step's weights for most models)
    out = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, name), framework="pt") as tensors:
            for key in tensors.keys():  # (safe_open: keys(), no iteration)
                if outside_language_model(key, args) or (mtp_layers and _is_mtp_layer(key, args)):
                    out[key] = tensors.get_tensor(key)
    return out


def _is_mtp_layer(hf_name: str, args: ModelArgs) -> bool:
    """A multi-token-prediction weight: GLM-4.5's / DeepSeek-V3's layers numbered after the decoder's last one,
    Qwen3-Next's ``mtp.*``."""
    if args.family in HYBRID_FAMILIES:
        return hf_name.startswith("mtp.")
    layer = _HF_LAYER.match(hf_name)
    return args.family in MTP_FAMILIES and layer is not None and int(layer.group(1)) >= args.num_layers


def hf_to_mcore(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The canonical Megatron state dict of an HF state dict (every tensor accounted for)."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"the HF checkpoint has no tensor {name!r} (expected for {args.family})")
        used.add(name)
        return hf[name]

    lm = args.hf_prefix
    out = {"embedding.word_embeddings.weight": take(lm + "embed_tokens.weight")}
    for i in range(args.num_layers):
        p, m = f"{lm}layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        attn = p + "self_attn."
        if i in args.linear_attention_layers:
            delta = p + "linear_attn."
            out[m + "self_attention.in_proj.weight"] = _delta_net_in_proj(take, delta, args)
            for suffix, hf_name in _DELTA_NET_NAMES:
                out[m + suffix] = take(delta + hf_name)
        elif args.multi_latent_attention:
            for suffix, hf_name in _mla_names(args):
                out[m + suffix] = take(attn + hf_name)
        else:
            fuse = fuse_gated_qkv if args.attention_output_gate else fuse_qkv
            out[m + "self_attention.linear_qkv.weight"] = fuse(
                take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"), args
            )
        if args.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias"), args
            )
        if i not in args.linear_attention_layers:  # (a delta net's output projection is its out_proj)
            if args.qk_layernorm and not args.multi_latent_attention:
                out[m + "self_attention.q_layernorm.weight"] = take(attn + "q_norm.weight")
                out[m + "self_attention.k_layernorm.weight"] = take(attn + "k_norm.weight")
            out[m + "self_attention.linear_proj.weight"] = take(attn + "o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        for suffix, hf_name in _mlp_names(args, i):
            if isinstance(hf_name, tuple):  # gate and up, fused by Megatron
                out[m + suffix] = torch.cat([take(p + hf_name[0]), take(p + hf_name[1])], dim=0)
            else:
                out[m + suffix] = take(p + hf_name)
        for suffix, hf_name in _post_norm_names(args):
            out[m + suffix] = take(p + hf_name)
    out["decoder.final_layernorm.weight"] = take(lm + "norm.weight")
    if not args.tie_embeddings:
        out["output_layer.weight"] = take(args.hf_head)
    elif args.hf_head in hf:
        used.add(args.hf_head)  # a tied checkpoint may store the shared tensor twice
    left = sorted(
        set(hf)
        - used
        - {
            n
            for n in hf
            if n.endswith("rotary_emb.inv_freq") or _is_mtp_layer(n, args) or outside_language_model(n, args)
        }
    )
    if left:
        raise ValueError(f"HF tensors with no Megatron counterpart ({args.family}): {left[:8]}")
    return out


# ---------------------------------------------------------------------------------------------- Megatron -> HF
def iter_mcore_to_hf(mcore: dict[str, torch.Tensor], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a canonical Megatron state dict, in HF's order; a tied lm_head is left out
    (as HF's save_pretrained does)."""
    mcore = from_te_names(mcore)
    lm = args.hf_prefix
    yield lm + "embed_tokens.weight", mcore["embedding.word_embeddings.weight"][: args.vocab_size]
    for i in range(args.num_layers):
        p, m = f"{lm}layers.{i}.", f"decoder.layers.{i}."
        attn = p + "self_attn."
        yield p + "input_layernorm.weight", mcore[m + "input_layernorm.weight"]
        if i in args.linear_attention_layers:
            delta = p + "linear_attn."
            for hf_name, tensor in _delta_net_hf_projections(mcore[m + "self_attention.in_proj.weight"], args):
                yield delta + hf_name, tensor
            for suffix, hf_name in _DELTA_NET_NAMES:
                yield delta + hf_name, mcore[m + suffix]
        elif args.multi_latent_attention:
            for suffix, hf_name in _mla_names(args):
                yield attn + hf_name, mcore[m + suffix]
        else:
            split = split_gated_qkv if args.attention_output_gate else split_qkv
            q, k, v = split(mcore[m + "self_attention.linear_qkv.weight"], args)
            yield attn + "q_proj.weight", q
            yield attn + "k_proj.weight", k
            yield attn + "v_proj.weight", v
        if args.add_qkv_bias:
            q, k, v = split_qkv(mcore[m + "self_attention.linear_qkv.bias"], args)
            yield attn + "q_proj.bias", q
            yield attn + "k_proj.bias", k
            yield attn + "v_proj.bias", v
        if i not in args.linear_attention_layers:
            if args.qk_layernorm and not args.multi_latent_attention:
                yield attn + "q_norm.weight", mcore[m + "self_attention.q_layernorm.weight"]
                yield attn + "k_norm.weight", mcore[m + "self_attention.k_layernorm.weight"]
            yield attn + "o_proj.weight", mcore[m + "self_attention.linear_proj.weight"]
        yield p + "post_attention_layernorm.weight", mcore[m + "pre_mlp_layernorm.weight"]
        for suffix, hf_name in _mlp_names(args, i):
            if isinstance(hf_name, tuple):
                gate, up = mcore[m + suffix].chunk(2, dim=0)
                yield p + hf_name[0], gate.contiguous()
                yield p + hf_name[1], up.contiguous()
            else:
                yield p + hf_name, mcore[m + suffix]
        for suffix, hf_name in _post_norm_names(args):
            yield p + hf_name, mcore[m + suffix]
    yield lm + "norm.weight", mcore["decoder.final_layernorm.weight"]
    if not args.tie_embeddings:
        yield args.hf_head, mcore["output_layer.weight"][: args.vocab_size]


def mcore_to_hf(mcore: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return dict(iter_mcore_to_hf(mcore, args))


# ---------------------------------------------------------------------------------------------- TP shards
_COLUMN = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "linear_fc1.weight",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")  # linear_fc*: dense, expert and shared MLPs


def merge_tp_shards(shards: list[dict[str, torch.Tensor]], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The canonical state dict of the per-rank state dicts of a tensor-parallel 'torch' checkpoint
    (rank order), with the vocabulary padding removed."""
    shards = [from_te_names({k: v for k, v in s.items() if not k.endswith("_extra_state")}) for s in shards]
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if len(parts) > 1 and name.endswith(_COLUMN):
            if name.endswith("linear_fc1.weight") and args.swiglu:
                halves = [p.chunk(2, dim=0) for p in parts]
                value = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                value = torch.cat(parts, dim=0)
        elif len(parts) > 1 and name.endswith(_ROW):
            value = torch.cat(parts, dim=1)
        else:
            value = parts[0]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            value = value[: args.vocab_size]
        out[name] = value
    return out


def pad_vocab(canonical: dict[str, torch.Tensor], padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state dict with zero rows appended to the embedding and output layer."""
    out = dict(canonical)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            value = out[name]
            out[name] = torch.cat([value, value.new_zeros(padded_vocab_size - value.shape[0], *value.shape[1:])])
    return out


# ---------------------------------------------------------------------------------------------- HF files
def read_hf_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF model folder (safetensors, or pytorch_model*.bin as a fallback)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for name in files:
            state.update(load_file(os.path.join(folder, name)))
        return state
    bins = sorted(f for f in os.listdir(folder) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not bins:
        raise FileNotFoundError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    for name in bins:
        state.update(torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True))
    return state


def write_hf_safetensors(
    tensors: dict[str, torch.Tensor], folder: str, *, max_shard_bytes: int = 5 * 1024**3
) -> list[str]:
    """Write ``tensors`` as HF does: model.safetensors, or shards plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {t: name for name, shard in zip(names, shards) for t in shard},
        }
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names
