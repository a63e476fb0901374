"""The architecture a Megatron GPTModel is built with, resolved from the Megatron flags and config.json.

Supported HF families: Qwen2 (QKV bias), Qwen3 (QK RMSNorm, explicit head_dim) and Llama (optionally
Llama 3.x RoPE scaling), and the mixture-of-experts Qwen3-MoE, Qwen2-MoE (a gated shared expert), Mixtral,
GLM-4.5 (``glm4_moe``: sigmoid routing with an expert bias, see below) and DeepSeek-V3 (``deepseek_v3``, also
Moonlight: that routing with multi-latent attention and YaRN RoPE). Each model flag, when given,
must agree with the HF config the engines serve; a flag left out takes the HF value. Nothing here imports
megatron-core.

MoE routing: Qwen3-MoE, Qwen2-MoE and Mixtral take a softmax over the router logits and keep the top k. With
renormalisation (Qwen3-MoE's usual ``norm_topk_prob: true``, Mixtral always) the kept weights equal a
softmax over the top-k logits alone, which is megatron-core's default router; without it (Qwen2-MoE's
``norm_topk_prob: false``) they are the full softmax's values, megatron-core's
``--moe-router-pre-softmax``.

GLM-4.5 (``glm4_moe``) routes as DeepSeek-V3 does, which is megatron-core's sigmoid router with an expert
bias: each expert's score is the sigmoid of its logit; the top k are chosen by score plus the expert's bias
(HF ``e_score_correction_bias``, Megatron ``router.expert_bias``; optionally only within the best
``n_group``/``topk_group`` groups), weighted by their scores renormalised over the k, times
``routed_scaling_factor``. Its first ``first_k_dense_replace`` layers are dense, its shared experts ungated, and
RoPE rotates the first ``partial_rotary_factor`` of each head (``--rotary-percent``).

Qwen3-Next (``qwen3_next``) and Qwen3.5's language models (``qwen3_5_text``, ``qwen3_5_moe_text``) are hybrids:
most layers mix tokens with a gated delta net (linear attention, megatron-core's ``GatedDeltaNet``), the others
(config.json's ``layer_types``) with softmax attention whose output is gated (``sigmoid(gate) * out``, the gate
projected beside each query head: ``--attention-output-gate``). Their RMSNorms hold their weight as an offset from
one (``x_normed * (1 + w)``: ``--apply-layernorm-1p``), RoPE rotates a quarter of each head, and their MoE layers
route as Qwen3-MoE's with a gated shared expert.

MiniMax-M2 (``minimax_m2``) routes as DeepSeek-V3 does without groups or scaling (sigmoid scores, an expert bias),
rotates half of each head, and norms its queries and keys over each token's whole projection (every head at
once) rather than head by head (``qk_norm_over_heads``).
"""

from __future__ import annotations

import dataclasses
import math

from vime.config.base import ConfigError
from vime.config.hf_values import config_value

DENSE_FAMILIES = ("qwen2", "qwen3", "llama", "glm4", "qwen3_5_text")
MOE_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "glm4_moe",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5_moe_text",
    "minimax_m2",
    "qwen3_omni_moe_text",
)
# gated delta-net (linear attention) layers between softmax-attention ones: Qwen3-Next and Qwen3.5's language models
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


@dataclasses.dataclass(frozen=True)
class LanguageModelLayout:
    """Where a multimodal checkpoint keeps its language model: the config's path to its text config (and that
    config's model_type), the prefix of its decoder's tensors and the name of its output head."""

    text_model_type: str
    config_path: tuple[str, ...]
    hf_prefix: str
    hf_head: str


# Multimodal checkpoints whose language model the Megatron backend trains, the other towers (vision, audio, a
# speech talker) carried unchanged: Qwen3.5's vision-language models, and Qwen3-Omni's thinker.
VISION_LANGUAGE_MODELS = {
    "qwen3_5": LanguageModelLayout("qwen3_5_text", ("text_config",), "model.language_model.", "lm_head.weight"),
    "qwen3_5_moe": LanguageModelLayout("qwen3_5_moe_text", ("text_config",), "model.language_model.", "lm_head.weight"),
    "qwen3_omni_moe": LanguageModelLayout(
        "qwen3_omni_moe_text", ("thinker_config", "text_config"), "thinker.model.", "thinker.lm_head.weight"
    ),
}
SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3")  # sigmoid scores + expert bias, dense first layers, ungated shared experts
MTP_FAMILIES = SIGMOID_ROUTED  # checkpoints with multi-token-prediction layers after the decoder's last
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
# The reference framework's layer-spec plugins (--spec MODULE FUNCTION) and the families whose layers each builds:
# vime builds those layers itself (the spec is read as a statement of the architecture, checked against config.json).
REFERENCE_LAYER_SPECS = {
    ("vime_plugins.models.glm4", "get_glm_spec"): ("glm4",),
    ("slime_plugins.models.glm4", "get_glm_spec"): ("glm4",),
    ("vime_plugins.models.qwen3_next", "get_qwen3_next_spec"): ("qwen3_next",),
    ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): ("qwen3_next",),
    ("vime_plugins.models.qwen3_5", "get_qwen3_5_spec"): ("qwen3_5_text", "qwen3_5_moe_text"),
    ("vime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"): ("minimax_m2",),
    ("vime_plugins.models.qwen3_omni_moe", "get_qwen3_omni_model_provider"): ("qwen3_omni_moe_text",),
    # Models vime's Megatron backend does not build (TORCH_BACKEND_FAMILIES): the torch backend trains HF's
    # implementation of them, and the spec is checked against config.json all the same.
    ("vime_plugins.models.gemma4", "get_gemma4_spec"): ("gemma4_text",),
    ("vime_plugins.models.gpt_oss", "get_gpt_oss_spec"): ("gpt_oss",),
    ("vime_plugins.models.glm5.glm5", "get_glm5_spec"): ("glm_moe_dsa",),
    ("slime_plugins.models.glm5.glm5", "get_glm5_spec"): ("glm_moe_dsa",),
}
# The reference's Megatron model providers (--custom-model-provider-path MODULE.FUNCTION), read as --spec is.
REFERENCE_MODEL_PROVIDERS = {"vime_plugins.models.gemma4_provider.model_provider": ("gemma4_text",)}
# Families of the reference's presets that only the torch backend trains here: Gemma 4 (sliding-window and global
# layers of two head sizes), gpt-oss (attention sinks, sliding windows, a clamped GeGLU) and GLM-5 (DeepSeek's
# sparse attention with its indexer).
TORCH_BACKEND_FAMILIES = ("gemma4_text", "gpt_oss", "glm_moe_dsa")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """A decoder-only transformer, dense or mixture-of-experts, as megatron-core builds it (and as HF
    names it)."""

    family: str  # HF model_type: one of FAMILIES
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dimension
    vocab_size: int  # unpadded (the HF vocabulary)
    norm_epsilon: float
    rotary_base: float
    add_qkv_bias: bool
    qk_layernorm: bool
    tie_embeddings: bool
    rope_scaling_factor: float | None = None  # Llama 3.x scaling (low 1, high 4, original 8192)
    max_position_embeddings: int = 4096
    rotary_percent: float = 1.0  # the fraction of each head's dimensions RoPE rotates (the first ones)
    rotary_interleaved: bool = False  # RoPE rotates pairs of adjacent dimensions (GLM-4) instead of the two halves
    # GLM-4: a norm on the attention's output and one on the MLP's, each before its residual add
    post_sublayer_norms: bool = False
    swiglu: bool = True
    normalization: str = "RMSNorm"
    # Mixture of experts (num_experts None: a dense model; ffn_hidden_size is then every layer's MLP).
    num_experts: int | None = None
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x . w) scales the shared expert
    moe_router_pre_softmax: bool = False  # top-k weights from the softmax over all experts (no renormalisation)
    moe_layers: tuple[int, ...] = ()  # 0-based indices of the MoE layers; the others are dense
    moe_router_score_function: str = "softmax"  # "sigmoid": GLM-4.5 / DeepSeek-V3 routing
    moe_router_enable_expert_bias: bool = False  # the top k chosen by score + a per-expert bias
    moe_router_topk_scaling_factor: float | None = None  # the k weights are multiplied by it
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many groups...
    moe_router_group_topk: int | None = None  # ...of which this many are kept per token
    # Multi-latent attention (DeepSeek-V3): queries through a low-rank q_lora_rank bottleneck (None: one
    # projection), keys and values from a shared kv_lora_rank latent; each head's query/key is qk_head_dim
    # dimensions without RoPE plus qk_pos_emb_head_dim with it (kv_channels is qk_head_dim), values v_head_dim.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE (rope_scaling type yarn; multi-latent attention only): its factor, original context and mscales.
    yarn: tuple[tuple[str, float], ...] = ()
    # MiniMax-M2: the query and key norms (qk_layernorm) over each token's whole projection, all heads at once,
    # instead of over each head
    qk_norm_over_heads: bool = False
    # Qwen3-Next, Qwen3.5: the softmax attention's output gated per head; every RMSNorm (the gated delta net's own
    # excepted) computing x_normed * (1 + weight)
    attention_output_gate: bool = False
    zero_centered_norms: bool = False
    # Where the language model's tensors are in the HF checkpoint: model.embed_tokens, model.layers.N, model.norm
    # and lm_head.weight (a multimodal checkpoint's: VISION_LANGUAGE_MODELS).
    hf_prefix: str = "model."
    hf_head: str = "lm_head.weight"
    # Gated delta-net layers (0-based; the others are softmax attention) and their shape: key heads (queries share
    # them) and value heads, each head's key and value dimensions, the causal convolution's width.
    linear_attention_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are gated delta nets (linear attention) instead of softmax attention."""
        return bool(self.linear_attention_layers)

    def linear_attention_pattern(self) -> list[int]:
        """megatron-core's ``linear_attention_freq`` as a list: 1 for a gated delta-net layer, 0 for attention."""
        return [int(i in self.linear_attention_layers) for i in range(self.num_layers)]

    def moe_layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` as a list: 1 for an MoE layer, 0 for a dense one."""
        return [int(i in self.moe_layers) for i in range(self.num_layers)]

    def padded_vocab_size(self, divisible_by: int, tensor_parallel: int) -> int:
        multiple = divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def yarn_fields(self) -> dict[str, float]:
        """megatron-core's YaRN fields (MLATransformerConfig), {} without YaRN."""
        return dict(self.yarn)


def _rope(hf_config) -> tuple[float, dict]:
    """(rope theta, scaling parameters or {}) across transformers' old and new config layouts."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    return float(theta), (merged if kind not in (None, "default") else {})


def rope_scaling_factor(hf_config) -> float:
    """config.json's RoPE scaling factor (Llama 3.x, YaRN, ...); 1.0 without scaling."""
    _, scaling = _rope(hf_config)
    return float(scaling.get("factor", 1.0)) if scaling else 1.0


def rope_scaling_kind(hf_config) -> str | None:
    """config.json's RoPE scaling type ('yarn', 'llama3', ...); None without scaling."""
    _, scaling = _rope(hf_config)
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def rotary_fraction(hf_config) -> float:
    """config.json's partial_rotary_factor (transformers 5 may keep it in rope_parameters); 1.0 without one."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return float(getattr(hf_config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0)


def language_model_config(hf_config):
    """The config of the language model: a multimodal checkpoint's (VISION_LANGUAGE_MODELS: Qwen3.5's text_config,
    Qwen3-Omni's thinker_config.text_config; others' HF ``get_text_config()``, Gemma 4's text_config), else
    ``hf_config`` itself."""
    layout = VISION_LANGUAGE_MODELS.get(getattr(hf_config, "model_type", None))
    if layout is None:
        # Another multimodal checkpoint (Gemma 4's): HF's own accessor finds its text config.
        get_text_config = getattr(hf_config, "get_text_config", None)
        return get_text_config() if callable(get_text_config) else hf_config
    return _along(hf_config, layout.config_path)[0]


def _along(hf_config, path: tuple[str, ...]):
    """The config at the end of ``path`` from ``hf_config``, and whether the head is tied: the outermost config on
    the way that says (Qwen3-Omni's thinker config, not its text config's; None where none does)."""
    config, tied = hf_config, getattr(hf_config, "tie_word_embeddings", None)
    for name in path:
        config = getattr(config, name)
        if tied is None:
            tied = getattr(config, "tie_word_embeddings", None)
    return config, tied


def model_args_from_hf(hf_config) -> ModelArgs:
    """The Megatron architecture of an HF config of a family in FAMILIES (or of a vision-language checkpoint's
    language model: VISION_LANGUAGE_MODELS); anything else is refused."""
    layout = VISION_LANGUAGE_MODELS.get(getattr(hf_config, "model_type", None))
    if layout is not None:
        text, tied = _along(hf_config, layout.config_path)
        if getattr(text, "model_type", None) != layout.text_model_type:
            raise ConfigError(
                "--hf-checkpoint",
                f"{hf_config.model_type}'s {'.'.join(layout.config_path)} is a {getattr(text, 'model_type', None)}, "
                f"not a {layout.text_model_type}",
            )
        args = model_args_from_hf(text)
        return dataclasses.replace(
            args,
            hf_prefix=layout.hf_prefix,
            hf_head=layout.hf_head,
            tie_embeddings=args.tie_embeddings if tied is None else bool(tied),
        )
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ConfigError(
            "--hf-checkpoint",
            f"model_type {family!r} is not supported by the Megatron backend (supported: {', '.join(FAMILIES)})",
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("--hf-checkpoint", "sliding-window attention is not supported by the Megatron backend")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(
            "--hf-checkpoint", f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) MLPs are supported"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise ConfigError("--hf-checkpoint", "MLP biases are not supported by the Megatron backend")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, scaling = _rope(hf_config)
    factor = None
    mla = _mla_from_hf(hf_config, scaling) if family == "deepseek_v3" else {}
    if mla:
        head_dim, scaling = mla["qk_head_dim"], {}  # Megatron-LM's kv_channels; YaRN is in mla["yarn"]
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        odd = {k: scaling.get(k) for k, v in expected.items() if float(scaling.get(k, v)) != v}
        if kind != "llama3" or odd:
            raise ConfigError(
                "--hf-checkpoint",
                f"RoPE scaling {scaling} is not supported: megatron-core implements "
                "Llama 3 scaling with low/high frequency factors 1/4 and an original "
                "context of 8192",
            )
        factor = float(scaling["factor"])
    rotary_percent = rotary_fraction(hf_config)
    if family not in ("glm4", "glm4_moe", "minimax_m2", *HYBRID_FAMILIES) and rotary_percent != 1.0:
        raise ConfigError(
            "--hf-checkpoint", f"partial_rotary_factor {rotary_percent} is not supported for {family} models"
        )
    if family == "qwen2":
        qkv_bias = True
    elif family == "qwen2_moe":
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
    elif mla and getattr(hf_config, "attention_bias", False):
        raise ConfigError("--hf-checkpoint", "multi-latent attention with attention_bias is not supported")
    elif family in HYBRID_FAMILIES and getattr(hf_config, "attention_bias", False):
        raise ConfigError("--hf-checkpoint", f"{family} with attention_bias is not supported by the Megatron backend")
    else:
        qkv_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelArgs(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        # (MLA: every head has its keys and values, up-projected from the shared latent)
        num_query_groups=heads if mla else getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=hf_config.vocab_size,
        norm_epsilon=float(hf_config.rms_norm_eps),
        rotary_base=theta,
        add_qkv_bias=qkv_bias,
        # (MLA: the query and key/value latents' norms, q_a_layernorm and kv_a_layernorm, megatron-core's qk_layernorm)
        qk_layernorm=family
        in ("qwen3", "qwen3_moe", "qwen3_omni_moe_text", "deepseek_v3", "minimax_m2", *HYBRID_FAMILIES)
        or bool(getattr(hf_config, "use_qk_norm", False)),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_scaling_factor=factor,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
        rotary_percent=rotary_percent,
        rotary_interleaved=family == "glm4",
        qk_norm_over_heads=family == "minimax_m2",
        post_sublayer_norms=family == "glm4",
        **mla,
        **(_moe_from_hf(hf_config) if family in MOE_FAMILIES else {}),
        **(_linear_attention_from_hf(hf_config) if family in HYBRID_FAMILIES else {}),
    )


def _linear_attention_from_hf(hf_config) -> dict:
    """A hybrid's gated delta-net layers (config.json's layer_types, else every full_attention_interval-th layer is
    softmax attention), its gated attention and its zero-centred norms."""
    layers = hf_config.num_hidden_layers
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    if not kinds:
        interval = int(getattr(hf_config, "full_attention_interval", 4) or 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if len(kinds) != layers or unknown:
        raise ConfigError(
            "--hf-checkpoint",
            f"layer_types must name linear_attention or full_attention for each of the {layers} layers "
            f"(got {len(kinds)} entries{', unknown ' + str(unknown) if unknown else ''})",
        )
    key_heads, value_heads = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if value_heads % key_heads:
        raise ConfigError(
            "--hf-checkpoint",
            f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}",
        )
    return dict(
        attention_output_gate=True,
        zero_centered_norms=True,
        linear_attention_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
    )


def _moe_from_hf(hf_config) -> dict:
    """The MoE fields of ModelArgs for a Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 or DeepSeek-V3 config."""
    family = hf_config.model_type
    layers = hf_config.num_hidden_layers
    if family in SIGMOID_ROUTED:
        return _sigmoid_routed_moe_from_hf(hf_config)
    if family == "minimax_m2":
        return _minimax_moe_from_hf(hf_config)
    if family == "mixtral":
        if getattr(hf_config, "sliding_window", None):
            raise ConfigError("--hf-checkpoint", "sliding-window attention is not supported by the Megatron backend")
        if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) > 0:
            raise ConfigError(
                "--hf-checkpoint",
                "Mixtral's router_jitter_noise > 0 is not supported (training "
                "would route differently from the engines)",
            )
        return dict(
            num_experts=hf_config.num_local_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.intermediate_size,
            moe_router_pre_softmax=False,
            moe_layers=tuple(range(layers)),
        )
    # Qwen*-MoE: layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not moe_layers:
        raise ConfigError(
            "--hf-checkpoint",
            f"{family} config with no MoE layer (decoder_sparse_step {step}, mlp_only_layers {sorted(dense)})",
        )
    gated_shared = family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")  # a shared expert scaled by sigmoid(x . w)
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) if gated_shared else None
    return dict(
        num_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        # (Qwen3.5-MoE always renormalises; its config has no norm_topk_prob)
        moe_router_pre_softmax=family != "qwen3_5_moe_text" and not bool(getattr(hf_config, "norm_topk_prob", False)),
        moe_layers=moe_layers,
    )


def _minimax_moe_from_hf(hf_config) -> dict:
    """MiniMax-M2's MoE: every layer's experts (``intermediate_size`` each), routed as DeepSeek-V3's are without
    groups or scaling: sigmoid scores, the top k chosen by score plus the expert bias, their scores renormalised."""
    if float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) > 0:
        raise ConfigError(
            "--hf-checkpoint",
            "MiniMax-M2's router_jitter_noise > 0 is not supported (training would route differently from the engines)",
        )
    return dict(
        num_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_layers=tuple(range(hf_config.num_hidden_layers)),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )


def _mla_from_hf(hf_config, scaling: dict) -> dict:
    """DeepSeek-V3's multi-latent attention fields, and its YaRN RoPE scaling (the only scaling it takes)."""
    yarn = ()
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise ConfigError(
                "--hf-checkpoint", f"RoPE scaling {scaling} is not supported with multi-latent attention (only yarn)"
            )
        yarn = (
            ("rotary_scaling_factor", float(scaling["factor"])),
            (
                "original_max_position_embeddings",
                float(scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings),
            ),
            ("beta_fast", float(scaling.get("beta_fast", 32))),
            ("beta_slow", float(scaling.get("beta_slow", 1))),
            ("mscale", float(scaling.get("mscale", 1.0))),
            ("mscale_all_dim", float(scaling.get("mscale_all_dim", 0.0))),
        )
    if not getattr(hf_config, "rope_interleave", True):
        raise ConfigError(
            "--hf-checkpoint", "rope_interleave false is not supported: megatron-core's MLA rotates interleaved pairs"
        )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=getattr(hf_config, "q_lora_rank", None) or None,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        yarn=yarn,
    )


def _sigmoid_routed_moe_from_hf(hf_config) -> dict:
    """GLM-4.5's and DeepSeek-V3's MoE fields: sigmoid scores, the expert bias, optional group-limited routing,
    scaled weights."""
    layers = hf_config.num_hidden_layers
    experts, topk = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    if topk > 1 and not getattr(hf_config, "norm_topk_prob", True):
        raise ConfigError(
            "--hf-checkpoint",
            f"{hf_config.model_type} with norm_topk_prob false is not supported: megatron-core's sigmoid router always "
            "renormalises the top-k weights",
        )
    groups, group_topk = int(getattr(hf_config, "n_group", 1) or 1), int(getattr(hf_config, "topk_group", 1) or 1)
    if groups > 1 and topk // group_topk != 2:
        # HF ranks a group by its two best experts; megatron-core by its best topk / group_topk.
        raise ConfigError(
            "--hf-checkpoint",
            f"group-limited routing with num_experts_per_tok {topk} and topk_group {group_topk} is not supported: "
            "megatron-core ranks groups by their best num_experts_per_tok / topk_group experts, HF by the best 2",
        )
    dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    if dense >= layers:
        raise ConfigError(
            "--hf-checkpoint", f"{hf_config.model_type} config with no MoE layer (first_k_dense_replace {dense})"
        )
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0) * hf_config.moe_intermediate_size
    scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=False,
        moe_layers=tuple(range(dense, layers)),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_flags_against_hf(flags, hf_config) -> ModelArgs | None:
    """Every model flag given (a switch: given as on) must agree with the HF config; raises ConfigError. Returns
    the architecture the Megatron backend would build (:func:`resolve_model_args`), or None where it builds none
    (the torch backend trains any HF causal LM)."""
    try:
        hf = model_args_from_hf(hf_config)
    except ConfigError:
        # Not an architecture the Megatron backend builds (the torch backend trains any HF causal LM):
        # only the plain numbers can be compared (a multimodal checkpoint's: its language model's). The Megatron
        # backend refuses it at start-up (check_megatron_builds_it).
        text = language_model_config(hf_config)
        _compare_numbers(
            flags,
            {
                "num_layers": config_value(text, "num_hidden_layers"),
                "hidden_size": config_value(text, "hidden_size"),
                "ffn_hidden_size": config_value(text, "intermediate_size"),
                "vocab_size": config_value(text, "vocab_size"),
                "num_attention_heads": config_value(text, "num_attention_heads"),
                "num_query_groups": config_value(text, "num_key_value_heads"),
                # (multi-latent attention: Megatron-LM's kv_channels is each head's query/key part without RoPE)
                "kv_channels": config_value(text, "qk_nope_head_dim") or config_value(text, "head_dim"),
                "norm_epsilon": config_value(text, "rms_norm_eps"),
                "q_lora_rank": config_value(text, "q_lora_rank"),
                "kv_lora_rank": config_value(text, "kv_lora_rank"),
                "qk_head_dim": config_value(text, "qk_nope_head_dim"),
                "qk_pos_emb_head_dim": config_value(text, "qk_rope_head_dim"),
                "v_head_dim": config_value(text, "v_head_dim"),
            },
        )
        if getattr(flags, "use_rollout_routing_replay", False):
            # The torch backend trains any HF model but cannot replay routes.
            families = ", ".join(MOE_FAMILIES)
            raise ConfigError(
                "--use-rollout-routing-replay",
                f"needs --train-backend megatron with a mixture-of-experts model ({families})",
            ) from None
        return None
    return _checked_against(flags, hf)


def mtp_layers_of(hf_config) -> int:
    """The multi-token-prediction layers config.json declares (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers,
    Qwen3-Next's and Qwen3.5's mtp_num_hidden_layers); 0 where it declares none."""
    for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = config_value(hf_config, name)
        if value is not None:
            return int(value)
    return 0


def check_megatron_builds_it(hf_config) -> None:
    """The Megatron backend builds --hf-checkpoint's model (said at start-up, not by a trainer that fails later);
    raises ConfigError naming the flag."""
    model_type = getattr(language_model_config(hf_config), "model_type", None)
    if model_type in TORCH_BACKEND_FAMILIES:
        raise ConfigError(
            "--train-backend",
            f"megatron: vime's Megatron backend does not build --hf-checkpoint's {model_type} layers; "
            "--train-backend torch trains HF's implementation of it",
        )
    model_args_from_hf(hf_config)


def _compare_numbers(flags, hf_values: dict) -> None:
    for name, hf_value in hf_values.items():
        given = getattr(flags, name, None)
        if given is None or hf_value is None:
            continue
        same = (
            math.isclose(float(given), float(hf_value), rel_tol=1e-9)
            if isinstance(hf_value, float)
            else given == hf_value
        )
        if not same:
            raise ConfigError(_flag(name), f"{given} disagrees with --hf-checkpoint's config.json ({hf_value})")


def resolve_model_args(flags, hf_config) -> ModelArgs:
    """The architecture from the Megatron flags (``MegatronConfig``), completed and checked by config.json."""
    return _checked_against(flags, model_args_from_hf(hf_config))


def _checked_against(flags, hf: ModelArgs) -> ModelArgs:
    """``hf`` (config.json's architecture) once every model flag given agrees with it; raises ConfigError."""
    _compare_numbers(
        flags,
        {
            "num_layers": hf.num_layers,
            "hidden_size": hf.hidden_size,
            "ffn_hidden_size": hf.ffn_hidden_size,
            "vocab_size": hf.vocab_size,
            "num_attention_heads": hf.num_attention_heads,
            "num_query_groups": hf.num_query_groups,
            "kv_channels": hf.kv_channels,
            "norm_epsilon": hf.norm_epsilon,
            "rotary_base": hf.rotary_base,
            "rope_scaling_factor": hf.rope_scaling_factor,
        },
    )
    if getattr(flags, "num_query_groups", None) is not None and not getattr(flags, "group_query_attention", True):
        raise ConfigError("--num-query-groups", "needs --group-query-attention")
    if getattr(flags, "group_query_attention", False) and hf.num_query_groups == hf.num_attention_heads:
        raise ConfigError(
            "--group-query-attention",
            f"config.json has as many key/value heads as heads ({hf.num_attention_heads}): not grouped-query attention",
        )
    _check_mla_flags(flags, hf)
    switches = {
        "multi_latent_attention": hf.multi_latent_attention,
        "qk_layernorm": hf.qk_layernorm,
        "add_qkv_bias": hf.add_qkv_bias,
        "swiglu": hf.swiglu,
        "untie_embeddings_and_output_weights": not hf.tie_embeddings,
        "use_rope_scaling": hf.rope_scaling_factor is not None,
        "use_rotary_position_embeddings": True,
        "disable_bias_linear": True,
        "rotary_interleaved": hf.rotary_interleaved,
        "post_self_attn_layernorm": hf.post_sublayer_norms,
        "post_mlp_layernorm": hf.post_sublayer_norms,
        "apply_layernorm_1p": hf.zero_centered_norms,
        "attention_output_gate": hf.attention_output_gate,
        "use_gated_attention": hf.attention_output_gate,
        "use_qwen_vl": hf.hf_prefix != "model.",  # a multimodal checkpoint (VISION_LANGUAGE_MODELS)
    }
    for name, hf_value in switches.items():
        if getattr(flags, name, False) and not hf_value:
            raise ConfigError(_flag(name), f"is given but --hf-checkpoint's config.json ({hf.family}) says otherwise")
    normalization = getattr(flags, "normalization", None)
    if normalization is not None and normalization != hf.normalization:
        raise ConfigError(
            "--normalization", f"{normalization} disagrees with --hf-checkpoint's config.json ({hf.normalization})"
        )
    _check_moe_flags(flags, hf)
    return hf


def _check_mla_flags(flags, hf: ModelArgs) -> None:
    """The multi-latent attention flags given must describe config.json's (a model without MLA takes none)."""
    numbers = {
        "q_lora_rank": hf.q_lora_rank,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_head_dim": hf.qk_head_dim,
        "qk_pos_emb_head_dim": hf.qk_pos_emb_head_dim,
        "v_head_dim": hf.v_head_dim,
    }
    for name, hf_value in numbers.items():
        given = getattr(flags, name, None)
        if given is None:
            continue
        if not hf.multi_latent_attention or given != hf_value:
            said = hf_value if hf.multi_latent_attention and hf_value else f"{hf.family}, no such latent or head"
            raise ConfigError(_flag(name), f"{given} disagrees with --hf-checkpoint's config.json ({said})")
    yarn = hf.yarn_fields()  # without RoPE scaling the mscales are moot
    if yarn:
        _compare_numbers(flags, {"mscale": yarn["mscale"], "mscale_all_dim": yarn["mscale_all_dim"]})


MOE_MODEL_FLAGS = (
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_pre_softmax",
    "moe_layer_freq",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
)


def parse_moe_layer_freq(text: str, num_layers: int | None = None) -> list[int] | int:
    """``--moe-layer-freq`` as Megatron-LM spells it: ``N`` (every N-th layer from the first is MoE) or a
    Python list expression of 0/1 per layer such as ``[1]*48`` or ``[0]+[1]*23``; raises ConfigError.
    With ``num_layers`` an ``N`` is expanded to the list."""
    import ast

    text = str(text).strip()
    if text.isdigit():
        freq = int(text)
        if freq < 1:
            raise ConfigError("--moe-layer-freq", "must be >= 1")
        return freq if num_layers is None else [int(i % freq == 0) for i in range(num_layers)]

    def value(node):  # only list literals of ints, + and * (no names, no calls)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or not pattern or any(v not in (0, 1) for v in pattern):
        raise ConfigError(
            "--moe-layer-freq",
            f"{text!r}: expected an integer or a list of 0/1 per layer such as '[1]*48' or '[0]+[1]*23'",
        )
    if num_layers is not None and len(pattern) != num_layers:
        raise ConfigError("--moe-layer-freq", f"{text!r} has {len(pattern)} entries for {num_layers} layers")
    return pattern


def _check_moe_flags(flags, hf: ModelArgs) -> None:
    """The MoE model flags given must describe the MoE architecture of config.json."""
    replay = bool(getattr(flags, "use_rollout_routing_replay", False))
    if not hf.is_moe:
        given = [name for name in MOE_MODEL_FLAGS if getattr(flags, name, None) not in (None, False)]
        if given:
            raise ConfigError(
                _flag(given[0]),
                f"is given but --hf-checkpoint's config.json ({hf.family}) is not a mixture-of-experts model",
            )
        if replay:
            raise ConfigError(
                "--use-rollout-routing-replay",
                f"needs a mixture-of-experts model (--num-experts, "
                f"--moe-router-topk); --hf-checkpoint's config.json "
                f"({hf.family}) has no experts",
            )
        return
    _compare_numbers(
        flags,
        {
            "num_experts": hf.num_experts,
            "moe_router_topk": hf.moe_router_topk,
            "moe_ffn_hidden_size": hf.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": hf.moe_shared_expert_intermediate_size,
        },
    )
    if (
        getattr(flags, "moe_shared_expert_intermediate_size", None) is not None
        and hf.moe_shared_expert_intermediate_size is None
    ):
        raise ConfigError(
            "--moe-shared-expert-intermediate-size",
            f"is given but --hf-checkpoint's config.json ({hf.family}) has no shared expert",
        )
    if getattr(flags, "moe_shared_expert_gate", False) and not hf.moe_shared_expert_gate:
        raise ConfigError(
            "--moe-shared-expert-gate",
            f"is given but --hf-checkpoint's config.json ({hf.family}) has no gated shared expert",
        )
    if (
        getattr(flags, "moe_router_pre_softmax", False)
        and hf.moe_router_score_function == "softmax"
        and not hf.moe_router_pre_softmax
    ):
        raise ConfigError(
            "--moe-router-pre-softmax",
            f"is given but --hf-checkpoint's config.json ({hf.family}) renormalises the top-k weights (norm_topk_prob)",
        )
    score = getattr(flags, "moe_router_score_function", None)
    if score is not None and score != hf.moe_router_score_function:
        raise ConfigError(
            "--moe-router-score-function", f"{score}: {hf.family} routes with a {hf.moe_router_score_function}"
        )
    if getattr(flags, "moe_router_enable_expert_bias", False) and not hf.moe_router_enable_expert_bias:
        raise ConfigError(
            "--moe-router-enable-expert-bias",
            f"is given but --hf-checkpoint's config.json ({hf.family}) routes without an expert bias",
        )
    _compare_numbers(flags, {"moe_router_topk_scaling_factor": hf.moe_router_topk_scaling_factor or 1.0})
    groups = {"moe_router_num_groups": hf.moe_router_num_groups, "moe_router_group_topk": hf.moe_router_group_topk}
    for name, hf_value in groups.items():
        given = getattr(flags, name, None)
        if given is not None and given != (hf_value or 1):  # 1: no group limit
            raise ConfigError(
                _flag(name), f"{given} disagrees with --hf-checkpoint's config.json ({hf_value or 'no groups'})"
            )
    freq = getattr(flags, "moe_layer_freq", None)
    if freq is not None and parse_moe_layer_freq(freq, hf.num_layers) != hf.moe_layer_pattern():
        raise ConfigError(
            "--moe-layer-freq",
            f"{freq!r} disagrees with --hf-checkpoint's config.json (MoE layers "
            f"{list(hf.moe_layers)} of {hf.num_layers})",
        )
