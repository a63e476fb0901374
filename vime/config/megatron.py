"""Megatron-style model and parallelism flags, as the reference usage guide lists them.

The torch backend trains the HF model from --hf-checkpoint; there these flags are optional and,
when given, must agree with the checkpoint's config.json (a mismatch names the flag). The Megatron
backend will build its model from them.
"""

from __future__ import annotations

import dataclasses

from vime.config.base import ConfigError, option


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    num_layers: int | None = option(None, "Transformer layers.")
    hidden_size: int | None = option(None, "Hidden size.")
    ffn_hidden_size: int | None = option(None, "MLP hidden size.")
    swiglu: bool = option(False, "SwiGLU MLP.")
    vocab_size: int | None = option(None, "Vocabulary size.")
    disable_bias_linear: bool = option(False, "No bias in linear layers.")
    num_attention_heads: int | None = option(None, "Attention heads.")
    group_query_attention: bool = option(False, "Grouped-query attention.")
    num_query_groups: int | None = option(None, "Key/value heads with --group-query-attention.")
    kv_channels: int | None = option(None, "Head dimension.")
    qk_layernorm: bool = option(False, "LayerNorm on queries and keys.")
    normalization: str | None = option(None, "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float | None = option(None, "Normalisation epsilon.")
    use_rotary_position_embeddings: bool = option(False, "Rotary position embeddings.")
    rotary_base: float | None = option(None, "RoPE base.")
    tensor_model_parallel_size: int = option(1, "Tensor parallelism of training.")
    sequence_parallel: bool = option(False, "Sequence parallelism (with TP).")
    pipeline_model_parallel_size: int = option(1, "Pipeline parallelism of training.")
    context_parallel_size: int = option(1, "Context parallelism of training.")
    expert_model_parallel_size: int = option(1, "Expert parallelism of training.")
    expert_tensor_parallel_size: int | None = option(None, "Tensor parallelism of MoE experts.")
    recompute_granularity: str | None = option(None, "Activation recomputation.", choices=["full", "selective"])
    recompute_method: str | None = option(None, "Recomputation method.", choices=["uniform", "block"])
    recompute_num_layers: int | None = option(None, "Layers per recomputation group.")

    def check_against_hf(self, hf_config) -> None:
        """With the torch backend, model flags are a cross-check of the HF config."""
        pairs = {
            "num_layers": getattr(hf_config, "num_hidden_layers", None),
            "hidden_size": getattr(hf_config, "hidden_size", None),
            "ffn_hidden_size": getattr(hf_config, "intermediate_size", None),
            "vocab_size": getattr(hf_config, "vocab_size", None),
            "num_attention_heads": getattr(hf_config, "num_attention_heads", None),
            "num_query_groups": getattr(hf_config, "num_key_value_heads", None),
            "norm_epsilon": getattr(hf_config, "rms_norm_eps", None),
        }
        for name, hf_value in pairs.items():
            given = getattr(self, name)
            if given is not None and hf_value is not None and given != hf_value:
                raise ConfigError("--" + name.replace("_", "-"),
                                  f"{given} disagrees with --hf-checkpoint's config.json ({hf_value})")

    def validate(self) -> None:
        parallel = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                    "context_parallel_size": 1, "expert_model_parallel_size": 1}
        for name, only in parallel.items():
            if getattr(self, name) != only:
                raise ConfigError("--" + name.replace("_", "-"),
                                  "model parallelism needs --train-backend megatron (not available yet)")
