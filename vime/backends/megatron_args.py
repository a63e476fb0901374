"""The architecture a Megatron GPTModel is built with, resolved from the Megatron flags and config.json.

Supported HF families: Qwen2 (QKV bias), Qwen3 (QK RMSNorm, explicit head_dim) and Llama (optionally
Llama 3.x RoPE scaling). Each model flag, when given, must agree with the HF config the engines
serve; a flag left out takes the HF value. Nothing here imports megatron-core.
"""

from __future__ import annotations

import dataclasses
import math

from vime.config.base import ConfigError

FAMILIES = ("qwen2", "qwen3", "llama")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """A dense decoder-only transformer as megatron-core builds it (and as HF names it)."""

    family: str                   # qwen2 | qwen3 | llama (HF model_type)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int              # head dimension
    vocab_size: int               # unpadded (the HF vocabulary)
    norm_epsilon: float
    rotary_base: float
    add_qkv_bias: bool
    qk_layernorm: bool
    tie_embeddings: bool
    rope_scaling_factor: float | None = None   # Llama 3.x scaling (low 1, high 4, original 8192)
    max_position_embeddings: int = 4096
    swiglu: bool = True
    normalization: str = "RMSNorm"

    def padded_vocab_size(self, divisible_by: int, tensor_parallel: int) -> int:
        multiple = divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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


def model_args_from_hf(hf_config) -> ModelArgs:
    """The Megatron architecture of an HF Qwen2 / Qwen3 / Llama config; anything else is refused."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ConfigError("--hf-checkpoint", f"model_type {family!r} is not supported by the Megatron backend "
                                             f"(supported: {', '.join(FAMILIES)})")
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("--hf-checkpoint", "sliding-window attention is not supported by the Megatron backend")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError("--hf-checkpoint", f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) MLPs "
                                             "are supported")
    if getattr(hf_config, "mlp_bias", False):
        raise ConfigError("--hf-checkpoint", "MLP biases are not supported by the Megatron backend")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, scaling = _rope(hf_config)
    factor = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        odd = {k: scaling.get(k) for k, v in expected.items() if float(scaling.get(k, v)) != v}
        if kind != "llama3" or odd:
            raise ConfigError("--hf-checkpoint", f"RoPE scaling {scaling} is not supported: megatron-core implements "
                                                 "Llama 3 scaling with low/high frequency factors 1/4 and an original "
                                                 "context of 8192")
        factor = float(scaling["factor"])
    return ModelArgs(
        family=family, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads, kv_channels=head_dim,
        vocab_size=hf_config.vocab_size, norm_epsilon=float(hf_config.rms_norm_eps), rotary_base=theta,
        add_qkv_bias=True if family == "qwen2" else bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=family == "qwen3", tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_scaling_factor=factor, max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_flags_against_hf(flags, hf_config) -> None:
    """Every model flag given (a switch: given as on) must agree with the HF config; raises ConfigError."""
    try:
        model_args_from_hf(hf_config)
    except ConfigError:
        # Not an architecture the Megatron backend builds (the torch backend trains any HF causal LM):
        # only the plain numbers can be compared. The Megatron backend refuses it when it starts.
        _compare_numbers(flags, {
            "num_layers": getattr(hf_config, "num_hidden_layers", None),
            "hidden_size": getattr(hf_config, "hidden_size", None),
            "ffn_hidden_size": getattr(hf_config, "intermediate_size", None),
            "vocab_size": getattr(hf_config, "vocab_size", None),
            "num_attention_heads": getattr(hf_config, "num_attention_heads", None),
            "num_query_groups": getattr(hf_config, "num_key_value_heads", None),
            "norm_epsilon": getattr(hf_config, "rms_norm_eps", None)})
        return
    resolve_model_args(flags, hf_config)


def _compare_numbers(flags, hf_values: dict) -> None:
    for name, hf_value in hf_values.items():
        given = getattr(flags, name, None)
        if given is None or hf_value is None:
            continue
        same = math.isclose(float(given), float(hf_value), rel_tol=1e-9) if isinstance(hf_value, float) \
            else given == hf_value
        if not same:
            raise ConfigError(_flag(name), f"{given} disagrees with --hf-checkpoint's config.json ({hf_value})")


def resolve_model_args(flags, hf_config) -> ModelArgs:
    """The architecture from the Megatron flags (``MegatronConfig``), completed and checked by config.json."""
    hf = model_args_from_hf(hf_config)
    _compare_numbers(flags, {
        "num_layers": hf.num_layers, "hidden_size": hf.hidden_size, "ffn_hidden_size": hf.ffn_hidden_size,
        "vocab_size": hf.vocab_size, "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_query_groups, "kv_channels": hf.kv_channels, "norm_epsilon": hf.norm_epsilon,
        "rotary_base": hf.rotary_base, "rope_scaling_factor": hf.rope_scaling_factor})
    if getattr(flags, "num_query_groups", None) is not None and not getattr(flags, "group_query_attention", True):
        raise ConfigError("--num-query-groups", "needs --group-query-attention")
    if getattr(flags, "group_query_attention", False) and hf.num_query_groups == hf.num_attention_heads:
        raise ConfigError("--group-query-attention", f"config.json has as many key/value heads as heads "
                                                     f"({hf.num_attention_heads}): not grouped-query attention")
    switches = {
        "qk_layernorm": hf.qk_layernorm, "add_qkv_bias": hf.add_qkv_bias, "swiglu": hf.swiglu,
        "untie_embeddings_and_output_weights": not hf.tie_embeddings,
        "use_rope_scaling": hf.rope_scaling_factor is not None,
        "use_rotary_position_embeddings": True, "disable_bias_linear": True,
    }
    for name, hf_value in switches.items():
        if getattr(flags, name, False) and not hf_value:
            raise ConfigError(_flag(name), f"is given but --hf-checkpoint's config.json ({hf.family}) says otherwise")
    normalization = getattr(flags, "normalization", None)
    if normalization is not None and normalization != hf.normalization:
        raise ConfigError("--normalization", f"{normalization} disagrees with --hf-checkpoint's config.json "
                                             f"({hf.normalization})")
    return hf
