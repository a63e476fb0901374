"""What the Megatron backend needs beyond the trainer spec shared with the torch backend: the model's
architecture (``megatron_args``), its parallel layout and MoE training options (``megatron_model``), the
checkpoint format, batching and the user's Megatron hooks, read from the parsed flags; and where the actor's
first weights come from.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from vime.backends.megatron_args import ModelArgs, resolve_model_args
from vime.backends.megatron_model import MoeOptions, Parallelism

if TYPE_CHECKING:
    from vime.backends.trainer_spec import TorchTrainerSpec


@dataclasses.dataclass(kw_only=True)
class MegatronBackendSpec:
    """What the Megatron backend needs beyond the trainer spec shared with the torch backend."""

    model: ModelArgs
    parallel: Parallelism = dataclasses.field(default_factory=Parallelism)
    ckpt_format: str = "torch_dist"
    ref_load: str | None = None  # Megatron checkpoint or HF folder: initial actor and KL reference
    packing: str = "auto"  # auto | thd | padded
    pad_size_multiplier: int = 1  # --data-pad-size-multiplier: sequence padding to a multiple of this x TP
    vocab_divisible_by: int = 128
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    recompute: dict | None = None  # TransformerConfig recompute_* fields
    # TransformerConfig fields from Megatron-LM flags (config.megatron_lm) and vime's kernel flags (megatron_perf).
    config_overrides: dict | None = None
    experimental: bool = False  # --enable-experimental: megatron-core's experimental flag
    moe: MoeOptions = dataclasses.field(default_factory=MoeOptions)  # MoE training; routing_replay = R3
    init_hook_path: str | None = None
    before_log_prob_hook_path: str | None = None
    before_train_step_hook_path: str | None = None
    hook_args: argparse.Namespace | None = None  # what user hooks receive as ``args``

    @classmethod
    def from_settings(cls, s) -> MegatronBackendSpec:
        from transformers import AutoConfig

        from vime.config.megatron_lm import transformer_overrides

        m = s.megatron
        recompute = {
            k: v
            for k, v in (
                ("recompute_granularity", m.recompute_granularity),
                ("recompute_method", m.recompute_method),
                ("recompute_num_layers", m.recompute_num_layers),
            )
            if v is not None
        }
        return cls(
            model=resolve_model_args(m, AutoConfig.from_pretrained(s.train.hf_checkpoint)),
            parallel=Parallelism(
                tensor=m.tensor_model_parallel_size,
                pipeline=m.pipeline_model_parallel_size,
                context=m.context_parallel_size,
                expert=m.expert_model_parallel_size,
                expert_tensor=m.expert_tensor_parallel_size,
                first_stage_layers=m.decoder_first_pipeline_num_layers,
                last_stage_layers=m.decoder_last_pipeline_num_layers,
                sequence_parallel=m.sequence_parallel and m.tensor_model_parallel_size > 1,
            ),
            ckpt_format=m.ckpt_format,
            ref_load=s.algorithm.ref_load,
            packing=m.megatron_packing,
            pad_size_multiplier=s.perf.data_pad_size_multiplier or 1,
            vocab_divisible_by=m.make_vocab_size_divisible_by,
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            recompute=recompute or None,
            # Megatron-LM flags passed through, then vime's own kernel flags (--attention-backend, ...).
            config_overrides={
                **(transformer_overrides(s.megatron_lm) if s.megatron_lm.values else {}),
                **s.perf.transformer_fields(),
            }
            or None,
            experimental=s.perf.enable_experimental,
            moe=MoeOptions(
                load_balancing_type=m.moe_router_load_balancing_type,
                aux_loss_coeff=m.moe_aux_loss_coeff,
                token_dispatcher_type=m.moe_token_dispatcher_type,
                grouped_gemm=m.moe_grouped_gemm,
                routing_replay=m.use_rollout_routing_replay,
                router_dtype=s.perf.router_dtype(),
                # The bias is config.json's whenever it has one; it moves only when asked (as in Megatron-LM).
                bias_update_rate=m.moe_router_bias_update_rate if m.moe_router_enable_expert_bias else 0.0,
            ),
            init_hook_path=m.custom_megatron_init_path,
            before_log_prob_hook_path=m.custom_megatron_before_log_prob_hook_path,
            before_train_step_hook_path=m.custom_megatron_before_train_step_hook_path,
            hook_args=s.args,
        )


def initial_canonical_source(spec: TorchTrainerSpec, megatron: MegatronBackendSpec) -> str:
    """Where the actor's first weights come from: --ref-load when given, else --hf-checkpoint."""
    return megatron.ref_load or spec.hf_checkpoint
