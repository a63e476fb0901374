"""Megatron-style model, parallelism, checkpoint and hook flags, as the reference usage guide lists them.

With ``--train-backend megatron`` the trainer builds a megatron-core GPTModel from these flags
(``vime.backends.megatron_model``); flags left out are read from --hf-checkpoint's config.json.
The engines serve that HF architecture, so a model flag that disagrees with config.json is an
error naming the flag, with either backend. A switch (``--qk-layernorm``, ``--swiglu``, ...) left
out means "as config.json says", not "off". ``scripts/models/*.sh`` hold the flags of common models.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vime.config.base import ConfigError, option, require

if TYPE_CHECKING:
    from vime.backends.megatron_args import ModelArgs


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    num_layers: int | None = option(None, "Transformer layers.")
    hidden_size: int | None = option(None, "Hidden size.")
    ffn_hidden_size: int | None = option(None, "MLP hidden size.")
    swiglu: bool = option(False, "SwiGLU MLP.")
    vocab_size: int | None = option(None, "Vocabulary size (unpadded; see --make-vocab-size-divisible-by).")
    make_vocab_size_divisible_by: int = option(
        128,
        "Pad the Megatron embedding and output layer to a multiple of this times the tensor-parallel size; "
        "padded rows never reach the HF weights and their logits are masked.",
    )
    disable_bias_linear: bool = option(False, "No bias in linear layers.")
    add_qkv_bias: bool = option(False, "Bias on the QKV projection only (Qwen2).")
    num_attention_heads: int | None = option(None, "Attention heads.")
    group_query_attention: bool = option(False, "Grouped-query attention.")
    num_query_groups: int | None = option(None, "Key/value heads with --group-query-attention.")
    kv_channels: int | None = option(None, "Head dimension.")
    qk_layernorm: bool = option(False, "LayerNorm on queries and keys.")
    normalization: str | None = option(None, "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float | None = option(None, "Normalisation epsilon.")
    use_rotary_position_embeddings: bool = option(False, "Rotary position embeddings.")
    position_embedding_type: str | None = option(
        None,
        "Position embeddings (Megatron-LM): vime's models take rotary ones, 'rope'; the others are refused.",
        choices=["learned_absolute", "rope", "mrope", "yarn", "none"],
    )
    max_position_embeddings: int | None = option(
        None, "Longest position the model takes (Megatron-LM); must agree with config.json's max_position_embeddings."
    )
    rotary_percent: float | None = option(
        None,
        "Fraction of each attention head's dimensions that RoPE rotates (Megatron-LM); must agree with "
        "config.json's partial_rotary_factor (1.0 where config.json has none).",
    )
    rotary_base: float | None = option(None, "RoPE base.")
    rotary_interleaved: bool = option(
        False, "RoPE rotates pairs of adjacent dimensions instead of the two halves of each head (GLM-4)."
    )
    post_self_attn_layernorm: bool = option(
        False, "A norm on the attention's output before its residual add (GLM-4; with --post-mlp-layernorm)."
    )
    post_mlp_layernorm: bool = option(
        False, "A norm on the MLP's output before its residual add (GLM-4; with --post-self-attn-layernorm)."
    )
    no_position_embedding: bool = option(
        False,
        "No learned absolute position embedding (Megatron-LM): vime's models never have one (they take RoPE).",
    )
    multi_latent_attention: bool = option(
        False,
        "Multi-latent attention (DeepSeek-V3, Moonlight: config.json's kv_lora_rank); the numbers below must agree "
        "with config.json. The Megatron backend builds it with tensor and context parallelism 1.",
    )
    q_lora_rank: int | None = option(
        None, "Rank of the query latent (config.json's q_lora_rank; none: one projection)."
    )
    kv_lora_rank: int | None = option(None, "Rank of the shared key/value latent (config.json's kv_lora_rank).")
    qk_head_dim: int | None = option(
        None, "Each head's query/key dimensions without RoPE (config.json's qk_nope_head_dim)."
    )
    qk_pos_emb_head_dim: int | None = option(
        None, "Each head's query/key dimensions with RoPE (config.json's qk_rope_head_dim)."
    )
    v_head_dim: int | None = option(None, "Each head's value dimensions (config.json's v_head_dim).")
    mscale: float | None = option(
        None, "YaRN's attention scale (config.json's rope_scaling mscale); moot without RoPE scaling."
    )
    mscale_all_dim: float | None = option(
        None, "YaRN's attention scale over all dimensions (config.json's rope_scaling mscale_all_dim); moot without it."
    )
    spec: list[str] | None = option(
        None,
        "A layer-spec plugin, MODULE FUNCTION (Megatron-LM). vime builds its models' layers itself and takes the "
        "reference framework's specs of the models it builds as statements of --hf-checkpoint's architecture: "
        "vime_plugins.models.glm4 get_glm_spec (GLM-4), vime_plugins.models.qwen3_next get_qwen3_next_spec "
        "(Qwen3-Next; also slime_plugins' of these two names), vime_plugins.models.qwen3_5 get_qwen3_5_spec "
        "(Qwen3.5's language models), vime_plugins.models.minimax_m2 get_minimax_m2_layer_spec (MiniMax-M2) and "
        "vime_plugins.models.qwen3_omni_moe get_qwen3_omni_model_provider (Qwen3-Omni's thinker); and, for models "
        "only the torch backend trains (HF's implementation), vime_plugins.models.gemma4 get_gemma4_spec (Gemma 4), "
        "vime_plugins.models.gpt_oss get_gpt_oss_spec (gpt-oss) and vime_plugins.models.glm5.glm5 get_glm5_spec "
        "(GLM-5, also slime_plugins'); any other spec is refused.",
        nargs=2,
        metavar=("MODULE", "FUNCTION"),
    )
    custom_model_provider_path: str | None = option(
        None,
        "A Megatron model provider, MODULE.FUNCTION (the reference's). vime builds its models itself and takes the "
        "reference's providers as --spec is taken, statements of --hf-checkpoint's architecture: "
        "vime_plugins.models.gemma4_provider.model_provider (Gemma 4, which the torch backend trains); any other "
        "provider is refused.",
    )
    allgather_cp: bool = option(
        False,
        "Split sequences over the context-parallel ranks in contiguous chunks gathered whole, not in the zigzag "
        "layout (the reference's; for DeepSeek's sparse-attention models, DeepSeek-V3.2 and GLM-5). With "
        "--context-parallel-size 1 it changes nothing, as in the reference; vime's context parallelism (the "
        "Megatron backend's, which does not build those models) keeps the zigzag layout, so it is refused with "
        "--context-parallel-size > 1.",
    )
    apply_layernorm_1p: bool = option(
        False,
        "Norms hold their weight as an offset from one, x_normed * (1 + weight) (Megatron-LM's zero-centred gamma; "
        "Qwen3-Next); must agree with config.json.",
    )
    attention_output_gate: bool = option(
        False,
        "Softmax attention's output scaled by sigmoid of a gate projected beside each query head, before the output "
        "projection (Qwen3-Next's gated attention); must agree with config.json.",
    )
    use_gated_attention: bool = option(
        False,
        "The reference framework's name for --attention-output-gate (its Qwen3-Next and Qwen3.5 presets pass both); "
        "must agree with config.json.",
    )
    use_qwen_vl: bool = option(
        False,
        "--hf-checkpoint is a Qwen multimodal checkpoint (Qwen3.5's vision-language models, Qwen3-Omni): the "
        "language model is trained, the vision and audio towers are carried unchanged into every export (the "
        "reference's Qwen-VL model provider); must agree with config.json.",
    )
    use_rope_scaling: bool = option(False, "Llama 3.x RoPE frequency scaling.")
    rope_scaling_factor: float | None = option(None, "Llama 3.x RoPE scaling factor (with --use-rope-scaling).")
    rotary_scaling_factor: float | None = option(
        None,
        "RoPE's context-extension factor (Megatron-LM's name, used with YaRN and by the reference's Llama 3.1 "
        "preset with --use-rope-scaling); must agree with config.json's rope_scaling factor (1.0 where "
        "config.json has no scaling).",
    )
    rope_type: str | None = option(
        None,
        "Megatron-LM's RoPE variant, 'rope' or 'yarn' (its default: yarn with --multi-latent-attention, else rope). "
        "vime takes the variant from config.json (YaRN where its rope_scaling is yarn, plain RoPE otherwise, Llama "
        "3.x scaling included); the flag must agree with it.",
        choices=["rope", "yarn"],
    )
    untie_embeddings_and_output_weights: bool = option(
        False, "Separate output layer (lm_head) instead of the tied input embedding."
    )
    attention_dropout: float = option(0.0, "Attention dropout (Megatron's default is 0.1; RL fine-tuning uses 0).")
    hidden_dropout: float = option(0.0, "Hidden dropout (Megatron's default is 0.1; RL fine-tuning uses 0).")
    tensor_model_parallel_size: int = option(1, "Tensor parallelism of training.")
    sequence_parallel: bool = option(
        False,
        "Sequence parallelism (with TP): norms and dropout over a slice of the sequence on each "
        "tensor-parallel rank. MoE models under tensor parallelism need it.",
    )
    pipeline_model_parallel_size: int = option(
        1,
        "Pipeline parallelism of training: the decoder layers split over this many stages, evenly unless "
        "--decoder-first/last-pipeline-num-layers say otherwise (Megatron backend; stages run one micro-batch at "
        "a time, see docs/parallelism.md).",
    )
    decoder_first_pipeline_num_layers: int | None = option(
        None,
        "Decoder layers of the first pipeline stage (default: an even split); the other stages share the rest evenly.",
    )
    decoder_last_pipeline_num_layers: int | None = option(
        None,
        "Decoder layers of the last pipeline stage (default: an even split); the other stages share the rest evenly.",
    )
    context_parallel_size: int = option(
        1,
        "Context parallelism of training: each sequence split over this many ranks, which gather each "
        "other's keys and values in every attention layer (Megatron backend, padded micro-batches; see "
        "docs/parallelism.md).",
    )
    expert_model_parallel_size: int = option(1, "Expert parallelism of training.")
    expert_tensor_parallel_size: int | None = option(
        None,
        "Tensor parallelism inside each MoE expert (default: --tensor-model-parallel-size): each expert's "
        "MLP is split over this many ranks (Megatron backend, torch_dist checkpoints).",
    )
    num_experts: int | None = option(
        None, "Routed experts per MoE layer (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3)."
    )
    moe_router_topk: int | None = option(None, "Experts each token is routed to (config.json: num_experts_per_tok).")
    moe_ffn_hidden_size: int | None = option(
        None,
        "Hidden size of each routed expert's MLP (config.json: moe_intermediate_size; Mixtral: intermediate_size).",
    )
    moe_shared_expert_intermediate_size: int | None = option(
        None,
        "Hidden size of the shared expert (Qwen2-MoE's shared_expert_intermediate_size; its sigmoid gate "
        "comes with it).",
    )
    moe_shared_expert_gate: bool = option(
        False,
        "The shared expert's output is scaled by a learned sigmoid gate (Megatron-LM's flag; Qwen2-MoE's "
        "shared_expert_gate). A cross-check: config.json decides, and the flag given for a model without one is "
        "refused.",
    )
    moe_router_pre_softmax: bool = option(
        False,
        "Top-k weights from the softmax over all experts, not renormalised over the chosen k "
        "(config.json norm_topk_prob: false).",
    )
    moe_router_score_function: str | None = option(
        None,
        "Router score function: softmax (Qwen*-MoE, Mixtral) or sigmoid (GLM-4.5, DeepSeek-V3); must agree with "
        "config.json.",
        choices=["softmax", "sigmoid"],
    )
    moe_router_enable_expert_bias: bool = option(
        False,
        "Choose the top-k experts by sigmoid score plus a per-expert bias (aux-loss-free load balancing; "
        "config.json's e_score_correction_bias: GLM-4.5, DeepSeek-V3). The bias is a model tensor: loaded from "
        "and exported to the HF weights and checkpointed. With this flag it is also updated after each optimizer step "
        "(--moe-router-bias-update-rate; Megatron backend); without it a model whose config.json has the bias "
        "routes with it, kept as loaded.",
    )
    moe_router_bias_update_rate: float = option(
        1e-3,
        "With an expert bias: after each optimizer step every MoE layer's bias moves by this much toward "
        "balance (+rate for each expert that got fewer tokens than the mean over the step's tokens on all ranks, "
        "-rate for one that got more; megatron-core's rule). 0 keeps the checkpoint's bias.",
    )
    moe_router_topk_scaling_factor: float | None = option(
        None, "The top-k weights are multiplied by this (config.json's routed_scaling_factor); must agree with it."
    )
    moe_router_num_groups: int | None = option(
        None,
        "Group-limited routing: the experts form this many groups (config.json's n_group); must agree with it.",
    )
    moe_router_group_topk: int | None = option(
        None,
        "Group-limited routing: the top-k experts come from this many groups per token (config.json's "
        "topk_group); must agree with it.",
    )
    moe_layer_freq: str | None = option(
        None,
        "Which layers are MoE: N (every N-th layer, from the first) or a list of 0/1 per layer such as "
        "'[1]*48' or '[0]+[1]*23' (default: config.json's decoder_sparse_step / mlp_only_layers).",
    )
    moe_token_drop_policy: str = option(
        "probs",
        "Which tokens an expert over its capacity drops (Megatron-LM): 'probs' or 'position'. Only read with a "
        "capacity factor; vime's MoE models are dropless, as HF's and the engines' are, so no token is dropped.",
        choices=["probs", "position"],
    )
    moe_router_load_balancing_type: str = option(
        "aux_loss",
        "Load-balancing loss of the router, active when --moe-aux-loss-coeff > 0: 'aux_loss' (over "
        "the micro-batch), 'seq_aux_loss' (per sequence), 'global_aux_loss' (over the optimizer step) or 'none'. "
        "'sinkhorn' is refused: it routes differently in training than the engines do.",
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
    )
    moe_aux_loss_coeff: float = option(
        0.0,
        "Weight of the load-balancing loss (0: none; its gradient is added "
        "to the policy loss's, averaged over the optimizer step's micro-batches).",
    )
    moe_grouped_gemm: bool = option(
        False,
        "Run the experts as one grouped GEMM (Transformer Engine on CUDA); without Transformer Engine "
        "the experts run one after another and this flag has no effect.",
    )
    moe_token_dispatcher_type: str = option(
        "allgather",
        "How tokens reach their experts: 'allgather', 'alltoall' (CUDA streams; the usual choice with expert "
        "parallelism) or 'flex' (megatron-core's dispatcher for DeepEP's kernels, --moe-enable-deepep). Where the "
        "trainer has no DeepEP (the deep_ep package on CUDA), 'flex' dispatches by alltoall, which sends the same "
        "tokens to the same experts: the results are the same, only the kernels differ.",
        choices=["allgather", "alltoall", "flex"],
    )
    use_mcore_models: bool = option(
        False,
        "Megatron-LM's switch to its megatron-core models; vime's Megatron backend builds only those, so there is "
        "nothing to switch.",
    )
    moe_enable_deepep: bool = option(
        False,
        "DeepEP's kernels for the flex dispatcher (Megatron-LM); needs --moe-token-dispatcher-type flex.",
    )
    use_rollout_routing_replay: bool = option(
        False,
        "R3, rollout routing replay (MoE, --train-backend megatron): the experts the rollout engine chose "
        "for each token are recorded with the sample (Sample.rollout_routed_experts, from vLLM's "
        "--enable-return-routed-experts) and forced in every Megatron forward over it; the router's "
        "probabilities for those experts are still the trainer's, so the router keeps learning.",
    )
    mtp_num_layers: int | None = option(
        None,
        "Multi-token-prediction layers of the model (Megatron-LM; DeepSeek-V3's and GLM-4.5's draft layers): must "
        "agree with config.json (num_nextn_predict_layers, or mtp_num_hidden_layers). vime's backends do not build "
        "them: the checkpoint's are carried unchanged into every export, so the engines' speculative decoding keeps "
        "using them, as the reference's do when they are not trained.",
    )
    enable_mtp_training: bool = option(
        False,
        "Train the multi-token-prediction layers with a loss on the rollouts' tokens (the reference's). Not built "
        "in vime, which carries those layers unchanged: refused at start-up.",
    )
    mtp_loss_scaling_factor: float | None = option(
        None,
        "Weight of the multi-token-prediction loss (Megatron-LM; its default 0.1). Read only with "
        "--enable-mtp-training, which vime does not build.",
    )
    recompute_granularity: str | None = option(
        None,
        "Activation recomputation: 'full' recomputes each layer's forward in the backward pass (the torch "
        "backend too, with HF gradient checkpointing: docs/real-models.md); 'selective' the attention core only "
        "(Megatron backend only).",
        choices=["full", "selective"],
    )
    recompute_method: str | None = option(None, "Recomputation method.", choices=["uniform", "block"])
    recompute_num_layers: int | None = option(None, "Layers per recomputation group.")
    ckpt_format: str = option(
        "torch_dist",
        "Format of the Megatron state in each iter_XXXXXXX/ (--train-backend megatron): 'torch' "
        "(mp_rank_XX/model_optim_rng.pt, one file per rank: load with the same parallelism) or 'torch_dist' "
        "(.distcp shards, loadable with any parallelism). Both formats load whatever this flag says.",
        choices=["torch", "torch_dist"],
    )
    megatron_packing: str = option(
        "auto",
        "How the Megatron backend batches sequences: 'thd' packs them back to back without padding "
        "(varlen attention; needs Transformer Engine on CUDA), 'padded' right-pads each micro-batch with a causal "
        "mask (megatron-core's own attention), 'auto' picks thd when Transformer Engine is usable. vime-specific.",
        choices=["auto", "thd", "padded"],
    )
    custom_megatron_init_path: str | None = option(
        None,
        "init(args), called once after the Megatron model parallel state is set up and before the model "
        "is built (--train-backend megatron).",
    )
    custom_megatron_before_log_prob_hook_path: str | None = option(
        None,
        "hook(args, model, store_prefix), called before log-probabilities are computed: store_prefix '' "
        "for the actor's old log-probs, 'ref_' for the reference model's; model is the list of model chunks.",
    )
    custom_megatron_before_train_step_hook_path: str | None = option(
        None,
        "hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler), called before each "
        "optimizer step's forward/backward passes (opt_param_scheduler is None: vime steps its own schedule, "
        "--lr-decay-style).",
    )

    def _validate_moe(self) -> None:
        from vime.backends.megatron_args import parse_moe_layer_freq

        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError("--" + name.replace("_", "-"), "must be >= 1")
        if None not in (self.num_experts, self.moe_router_topk) and self.moe_router_topk > self.num_experts:
            raise ConfigError(
                "--moe-router-topk", f"{self.moe_router_topk} is more than --num-experts {self.num_experts}"
            )
        if self.moe_layer_freq is not None:
            parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        if self.moe_router_load_balancing_type == "sinkhorn":
            raise ConfigError(
                "--moe-router-load-balancing-type",
                "'sinkhorn' routes tokens differently in training "
                "than at inference (where the engines take the plain "
                "top-k); use aux_loss, seq_aux_loss, global_aux_loss "
                "or none",
            )
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError("--moe-aux-loss-coeff", "must be >= 0")
        if self.moe_enable_deepep and self.moe_token_dispatcher_type != "flex":
            raise ConfigError(
                "--moe-enable-deepep",
                f"needs --moe-token-dispatcher-type flex (got {self.moe_token_dispatcher_type})",
            )
        if self.moe_router_bias_update_rate < 0:
            raise ConfigError("--moe-router-bias-update-rate", f"must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.moe_router_topk_scaling_factor is not None and self.moe_router_topk_scaling_factor <= 0:
            raise ConfigError(
                "--moe-router-topk-scaling-factor", f"must be > 0, got {self.moe_router_topk_scaling_factor}"
            )
        for name in ("moe_router_num_groups", "moe_router_group_topk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError("--" + name.replace("_", "-"), "must be >= 1")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ConfigError(
                "--moe-router-group-topk" if self.moe_router_group_topk is None else "--moe-router-num-groups",
                "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk",
            )
        if None not in (self.moe_router_num_groups, self.moe_router_group_topk) and (
            self.moe_router_group_topk > self.moe_router_num_groups
        ):
            raise ConfigError(
                "--moe-router-group-topk",
                f"{self.moe_router_group_topk} is more than --moe-router-num-groups {self.moe_router_num_groups}",
            )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            raise ConfigError("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid")

    def _named_families(self) -> dict[str, tuple[str, ...] | None]:
        """The model families --spec and --custom-model-provider-path each build (None: the flag names none)."""
        from vime.backends.megatron_args import REFERENCE_LAYER_SPECS, REFERENCE_MODEL_PROVIDERS

        return {
            "--spec": REFERENCE_LAYER_SPECS.get(tuple(self.spec or ())),
            "--custom-model-provider-path": REFERENCE_MODEL_PROVIDERS.get(self.custom_model_provider_path),
        }

    def names_torch_only_model(self) -> bool:
        """--spec or --custom-model-provider-path names a model only the torch backend trains (HF's)."""
        from vime.backends.megatron_args import TORCH_BACKEND_FAMILIES

        named = [family for families in self._named_families().values() for family in families or ()]
        return bool(named) and all(family in TORCH_BACKEND_FAMILIES for family in named)

    def check_against_hf(self, hf_config, train_backend: str | None = None) -> ModelArgs | None:
        """Model flags are cross-checks of the HF config (either backend); a mismatch names the flag.
        ``train_backend`` (when known) refuses R3 with the torch backend, which cannot replay routes. Returns the
        architecture the Megatron backend builds from it (None: a model only the torch backend trains)."""
        from vime.backends.megatron_args import check_flags_against_hf, language_model_config

        model = check_flags_against_hf(self, hf_config)
        given_config, hf_config = hf_config, language_model_config(hf_config)  # (a multimodal one: its LM's)
        positions = getattr(hf_config, "max_position_embeddings", None)
        require(
            self.max_position_embeddings is None or positions is None or self.max_position_embeddings == positions,
            "--max-position-embeddings",
            f"{self.max_position_embeddings} disagrees with --hf-checkpoint's config.json ({positions})",
        )
        from vime.backends.megatron_args import check_megatron_builds_it, mtp_layers_of, rotary_fraction

        model_type = getattr(hf_config, "model_type", None)
        given = {"--spec": " ".join(self.spec or ()), "--custom-model-provider-path": self.custom_model_provider_path}
        for flag, families in self._named_families().items():
            require(
                families is None or model_type in families,
                flag,
                f"{given[flag]} builds {' or '.join(families or ())} layers, but --hf-checkpoint's config.json is a "
                f"{model_type}",
            )
        if train_backend == "megatron" and model is None:
            check_megatron_builds_it(given_config)  # raises: the Megatron backend builds no such model
        if self.mtp_num_layers is not None:
            layers = mtp_layers_of(hf_config)
            require(
                layers == self.mtp_num_layers,
                "--mtp-num-layers",
                f"{self.mtp_num_layers} disagrees with --hf-checkpoint's config.json ({layers} multi-token-prediction "
                "layers)",
            )
        rotary = rotary_fraction(hf_config)
        require(
            self.rotary_percent is None or abs(self.rotary_percent - rotary) < 1e-9,
            "--rotary-percent",
            f"{self.rotary_percent} disagrees with --hf-checkpoint's config.json (partial_rotary_factor {rotary})",
        )
        if self.moe_router_enable_expert_bias and self.moe_router_bias_update_rate > 0 and train_backend == "torch":
            raise ConfigError(
                "--moe-router-bias-update-rate",
                f"{self.moe_router_bias_update_rate}: the torch backend keeps the HF model's expert bias "
                "(e_score_correction_bias) as loaded; pass 0, or use --train-backend megatron",
            )
        if self.rope_type is not None:
            from vime.backends.megatron_args import rope_scaling_kind

            kind = rope_scaling_kind(hf_config)
            require(
                (kind == "yarn") == (self.rope_type == "yarn"),
                "--rope-type",
                f"{self.rope_type!r} disagrees with --hf-checkpoint's config.json (RoPE scaling: {kind or 'none'}; "
                f"give {'yarn' if kind == 'yarn' else 'rope'} or leave the flag out)",
            )
        if self.rotary_scaling_factor is not None:
            from vime.backends.megatron_args import rope_scaling_factor

            factor = rope_scaling_factor(hf_config)
            require(
                abs(self.rotary_scaling_factor - factor) < 1e-9,
                "--rotary-scaling-factor",
                f"{self.rotary_scaling_factor} disagrees with --hf-checkpoint's config.json (RoPE scaling factor "
                f"{factor})",
            )
        if self.use_rollout_routing_replay and train_backend not in (None, "megatron"):
            raise ConfigError(
                "--use-rollout-routing-replay",
                f"needs --train-backend megatron (the {train_backend} backend cannot force the recorded experts)",
            )
        return model

    def validate(self) -> None:
        require(self.tensor_model_parallel_size >= 1, "--tensor-model-parallel-size", "must be >= 1")
        require(self.expert_model_parallel_size >= 1, "--expert-model-parallel-size", "must be >= 1")
        require(self.pipeline_model_parallel_size >= 1, "--pipeline-model-parallel-size", "must be >= 1")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(self, name) is not None:
                flag = "--" + name.replace("_", "-")
                require(getattr(self, name) >= 1, flag, "must be >= 1")
                require(self.pipeline_model_parallel_size > 1, flag, "needs --pipeline-model-parallel-size > 1")
        require(self.context_parallel_size >= 1, "--context-parallel-size", "must be >= 1")
        if self.context_parallel_size > 1 and self.megatron_packing == "thd":
            raise ConfigError(
                "--context-parallel-size",
                "packed (thd) sequences are not supported with context "
                "parallelism; use --megatron-packing padded or auto",
            )
        require(
            self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
            "--expert-tensor-parallel-size",
            "must be >= 1",
        )
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError("--make-vocab-size-divisible-by", "must be >= 1")
        require(
            self.position_embedding_type in (None, "rope"),
            "--position-embedding-type",
            f"{self.position_embedding_type!r}: vime's models take rotary position embeddings ('rope') only",
        )
        if self.spec is not None:
            from vime.backends.megatron_args import REFERENCE_LAYER_SPECS

            known = "; ".join(" ".join(spec) for spec in REFERENCE_LAYER_SPECS)
            require(
                tuple(self.spec) in REFERENCE_LAYER_SPECS,
                "--spec",
                f"{' '.join(self.spec)}: vime builds its models' layers itself and takes only the reference "
                f"framework's specs of models it trains ({known}); a custom layer spec is not supported",
            )
        if self.custom_model_provider_path is not None:
            from vime.backends.megatron_args import REFERENCE_MODEL_PROVIDERS

            require(
                self.custom_model_provider_path in REFERENCE_MODEL_PROVIDERS,
                "--custom-model-provider-path",
                f"{self.custom_model_provider_path}: vime builds its models itself and takes only the reference "
                f"framework's providers of models it trains ({'; '.join(REFERENCE_MODEL_PROVIDERS)}); a custom "
                "Megatron model provider is not supported",
            )
        require(
            not self.enable_mtp_training,
            "--enable-mtp-training",
            "training the multi-token-prediction layers is not built in vime: its backends carry the checkpoint's "
            "MTP layers unchanged into every export (leave the flag and --mtp-loss-scaling-factor out; "
            "--mtp-num-layers alone is accepted)",
        )
        require(
            self.mtp_loss_scaling_factor is None,
            "--mtp-loss-scaling-factor",
            "is read only with --enable-mtp-training, which vime does not build",
        )
        require(
            self.mtp_num_layers is None or self.mtp_num_layers >= 0,
            "--mtp-num-layers",
            f"must be >= 0, got {self.mtp_num_layers}",
        )
        require(
            not (self.allgather_cp and self.context_parallel_size > 1),
            "--allgather-cp",
            f"with --context-parallel-size {self.context_parallel_size}: the reference allows the all-gather layout "
            "for DeepSeek's sparse-attention models only (DeepSeek-V3.2, GLM-5), which vime's Megatron backend does "
            "not build; its context parallelism keeps the zigzag layout (leave --allgather-cp out)",
        )
        require(
            self.rotary_percent is None or 0 < self.rotary_percent <= 1,
            "--rotary-percent",
            f"must be in (0, 1], got {self.rotary_percent}",
        )
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value is None or value >= 1, flag, f"must be >= 1, got {value}")
            require(value is None or self.multi_latent_attention, flag, "needs --multi-latent-attention")
        require(
            self.rotary_scaling_factor is None or self.rotary_scaling_factor > 0,
            "--rotary-scaling-factor",
            f"must be > 0, got {self.rotary_scaling_factor}",
        )
        if self.rope_scaling_factor is not None and not self.use_rope_scaling:
            raise ConfigError("--rope-scaling-factor", "needs --use-rope-scaling")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError("--" + name.replace("_", "-"), "must be in [0, 1)")
        self._validate_moe()
        from vime.runtime.plugins import PluginError, absolute_plugin_path

        for name in (
            "custom_megatron_init_path",
            "custom_megatron_before_log_prob_hook_path",
            "custom_megatron_before_train_step_hook_path",
        ):
            if getattr(self, name):
                from vime.backends.megatron_hooks import load_megatron_hook

                flag = "--" + name.replace("_", "-")
                setattr(self, name, absolute_plugin_path(getattr(self, name)))  # workers may run elsewhere
                try:
                    load_megatron_hook(flag, getattr(self, name))  # a bad path or signature fails at start-up
                except PluginError as error:
                    raise ConfigError(flag, str(error).removeprefix(flag).strip()) from None
