"""Megatron-LM's and the reference framework's kernel, fusion, precision, offload and memory flags.

The reference's launch scripts pass these in nearly every ``PERF_ARGS``/``OPTIMIZER_ARGS``/``MISC_ARGS``
array. Their names, types, defaults and choices are Megatron-LM's (``megatron/training/arguments.py``,
core_v0.16.1) and slime's (``slime/utils/arguments.py``). Some act on vime's backends (``--attention-backend``,
``--attention-softmax-in-fp32`` and ``--moe-router-dtype`` on the Megatron backend's TransformerConfig); the
others ask for a kernel, a fusion or an offload that vime's backends do not have, or for what vime always does
(float32 gradient accumulation). Those are accepted and the run says once at start-up what each does there
(:meth:`MegatronPerfConfig.startup_notes`, said by ``vime.preflight``): never refused for being a no-op on
this device, never silently ignored. docs/megatron.md lists them.

``--optimizer`` and ``--sgd-momentum`` live with the other optimizer flags (vime.config.training).
"""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require

# Why each precision-aware optimizer dtype flag takes only the values it does (MegatronPerfConfig.validate).
UNIMPLEMENTED_DTYPES = {
    "--exp-avg-dtype": "moments are stored in fp32 or bf16 (fp16 and fp8 need per-tensor scaling)",
    "--exp-avg-sq-dtype": "moments are stored in fp32 or bf16 (fp16 and fp8 need per-tensor scaling)",
    "--main-grads-dtype": "gradients are accumulated and reduced in fp32",
    "--main-params-dtype": "master weights are fp32",
}

ATTENTION_BACKENDS = ["flash", "fused", "unfused", "local", "auto"]  # megatron.core.transformer.enums.AttnBackend

# Megatron-LM's ``--no-*-fusion`` flags store False into these destinations of ``args``; vime's fields are named
# after the flags, and finalize() sets the reference's destinations too, for hooks that read them.
FUSION_DESTINATIONS = {
    "no_rope_fusion": "apply_rope_fusion",
    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion",
    "no_masked_softmax_fusion": "masked_softmax_fusion",
    "no_bias_dropout_fusion": "bias_dropout_fusion",
    "no_bias_gelu_fusion": "bias_gelu_fusion",
}


# The reference's Megatron-to-HF converters, by the substrings of the model name (lower case, '-' and '_' dropped)
# that select each, in the order it tries them (slime/backends/megatron_utils/megatron_to_hf, 624b824a8).
REFERENCE_CONVERTERS = (
    (("minimaxm2",), "MiniMax-M2"),
    (("glm4moelite", "deepseekv3", "deepseekv32", "glmmoedsa", "kimi"), "DeepSeek-V3"),
    (("glm4moe",), "GLM-4.5"),
    (("glm4",), "GLM-4"),
    (("qwen3next",), "Qwen3-Next"),
    (("qwen35",), "Qwen3.5"),
    (("qwen3vl",), "Qwen3-VL"),
    (("qwen2moe", "qwen3moe"), "Qwen-MoE"),
    (("qwen2", "qwen3"), "Qwen"),
    (("llama",), "Llama"),
    (("mimo",), "MiMo"),
)


def reference_converter(model_name: str) -> str | None:
    """The converter the reference picks for ``model_name`` (None: it has none for it)."""
    key = model_name.lower().replace("_", "").replace("-", "")
    return next((converter for names, converter in REFERENCE_CONVERTERS if any(n in key for n in names)), None)


@dataclasses.dataclass(kw_only=True)
class MegatronPerfConfig:
    accumulate_allreduce_grads_in_fp32: bool = option(
        False,
        "Gradient accumulation and all-reduce in fp32 (Megatron-LM). vime always does so: gradients of float32 "
        "parameters, or with --bf16 of the float32 master weights, add up and are summed over ranks in float32.",
    )
    attention_softmax_in_fp32: bool = option(
        False,
        "Run attention masking and softmax in fp32 (Megatron-LM). The Megatron backend computes them in float32 "
        "with or without this flag (megatron-core's default, which vime keeps); the torch backend's attention is "
        "HF's, which chooses its own precision.",
    )
    attention_backend: str = option(
        "auto",
        "Attention kernel (Megatron-LM): flash, fused, unfused or auto pick Transformer Engine's kernel on the "
        "Megatron backend (on CUDA with Transformer Engine; without it megatron-core's own attention runs); "
        "'local' is megatron-core's own attention, which vime uses whenever Transformer Engine is absent. The "
        "torch backend runs HF's attention whatever this says.",
        choices=ATTENTION_BACKENDS,
    )
    moe_router_dtype: str | None = option(
        None,
        "Data type of MoE routing and of the weighted sum of the experts' outputs (Megatron-LM): fp32 or fp64. "
        "Left out, vime's Megatron backend routes in fp32 (as HF's routers do, so that training and the engines "
        "choose the same experts); fp64 routes in float64 there. The torch backend's HF routers compute in "
        "float32.",
        choices=["fp32", "fp64"],
    )
    use_flash_attn: bool = option(
        False,
        "FlashAttention (Megatron-LM's older switch, which Megatron-LM turns into --attention-backend flash). The "
        "Megatron backend then asks for Transformer Engine's flash kernel where --attention-backend is left at "
        "auto (on CUDA with Transformer Engine; without it megatron-core's own attention runs); the torch "
        "backend runs HF's attention.",
    )
    moe_permute_fusion: bool = option(
        False,
        "Fuse the MoE tokens' permutation and unpermutation (Megatron-LM; Transformer Engine's kernels). vime's "
        "Megatron backend builds its models with the fusions off on every device: no effect.",
    )
    seq_length: int | None = option(
        None,
        "Megatron-LM's training sequence length (pretraining's fixed-length samples). RL samples keep their own "
        "lengths (--rollout-max-response-len bounds them, --max-tokens-per-gpu packs them): vime's trainers do "
        "not read it.",
    )
    no_rope_fusion: bool = option(
        False, "Disable the fused RoPE kernel (Megatron-LM). vime's Megatron backend never uses it."
    )
    no_gradient_accumulation_fusion: bool = option(
        False,
        "Disable fusing gradient accumulation into the weight-gradient GEMM of linear layers (Megatron-LM; APEX "
        "or Transformer Engine). vime's Megatron backend never fuses it.",
    )
    no_masked_softmax_fusion: bool = option(
        False,
        "Disable the fused scale + mask + softmax kernel (Megatron-LM). vime's Megatron backend never uses it.",
    )
    no_bias_dropout_fusion: bool = option(
        False, "Disable the fused bias + dropout + add kernel (Megatron-LM). vime's Megatron backend never uses it."
    )
    no_bias_gelu_fusion: bool = option(
        False,
        "Disable the fused bias + GeLU kernel (Megatron-LM). vime's Megatron backend never uses it (nor any fused "
        "bias + activation).",
    )
    enable_experimental: bool = option(
        False,
        "Switch on megatron-core's experimental features (Megatron-LM: megatron.core.config's experimental flag), "
        "set in the Megatron backend's trainers; the torch backend has none.",
    )
    optimizer_cpu_offload: bool = option(
        False,
        "Offload the optimizer state and step to the CPU (Megatron-LM's hybrid optimizer; needs "
        "--use-precision-aware-optimizer, as Megatron-LM asks). vime's optimizer steps where the trainer's "
        "parameters are (host memory on CPU); on GPUs its state is not offloaded (--offload-train moves it to "
        "host memory between steps; --use-distributed-optimizer shards it).",
    )
    optimizer_offload_fraction: float = option(
        1.0, "Fraction of the optimizer state --optimizer-cpu-offload puts on the CPU (Megatron-LM)."
    )
    overlap_cpu_optimizer_d2h_h2d: bool = option(
        False,
        "Overlap the CPU optimizer step with the gradients' device-to-host and the parameters' host-to-device "
        "copies (Megatron-LM, with --optimizer-cpu-offload). vime has no CPU-offloaded optimizer step to overlap.",
    )
    use_precision_aware_optimizer: bool = option(
        False,
        "Transformer Engine's precision-aware optimizer, which may keep master weights and optimizer state in "
        "lower precision (Megatron-LM). With Megatron-LM's default dtypes (fp32) that is what vime does: float32 "
        "master weights and optimizer state; --exp-avg-dtype / --exp-avg-sq-dtype bf16 store AdamW's moments in "
        "bf16 (torch backend).",
    )
    exp_avg_dtype: str = option(
        "fp32",
        "Storage dtype of AdamW's first moment, with --use-precision-aware-optimizer (Megatron-LM). vime: fp32 or "
        "bf16, on either backend (the update is computed in float32; docs/real-models.md); fp16 and fp8, which "
        "need per-tensor scaling, are not implemented.",
        choices=["fp32", "fp16", "bf16", "fp8"],
    )
    exp_avg_sq_dtype: str = option(
        "fp32",
        "Storage dtype of AdamW's second moment, with --use-precision-aware-optimizer (Megatron-LM); as "
        "--exp-avg-dtype.",
        choices=["fp32", "fp16", "bf16", "fp8"],
    )
    main_grads_dtype: str = option(
        "fp32",
        "Dtype of the gradients the optimizer reads, with --use-precision-aware-optimizer (Megatron-LM). vime "
        "accumulates and reduces them in float32 (fp32); bf16 is not implemented.",
        choices=["fp32", "bf16"],
    )
    main_params_dtype: str = option(
        "fp32",
        "Dtype of the master weights, with --use-precision-aware-optimizer (Megatron-LM). vime keeps float32 "
        "masters (fp32); fp16 is not implemented.",
        choices=["fp32", "fp16"],
    )
    train_memory_margin_bytes: int = option(
        1024**3,
        "GPU memory the trainer leaves free when it reloads its offloaded state (the reference's torch_memory_saver "
        "margin). vime reserves none: --offload-train moves the trainer's tensors to host memory and back, and "
        "the engines' share is --vllm-gpu-memory-utilization.",
    )
    data_pad_size_multiplier: int | None = option(
        None,
        "Pad each micro-batch's sequence dimension on the Megatron backend to a multiple of this times the "
        "tensor-parallel size (the reference's option, for kernel alignment and less memory fragmentation on "
        "GPUs): the packed (thd) token count, or the padded rows' length. Results do not change. Unset (vime's "
        "default; the reference's is 128): only the padding that sequence and context parallelism need. The "
        "torch backend pads nothing for alignment and does not read it.",
    )
    deterministic_mode: bool = option(
        False,
        "Train with deterministic algorithms only (Megatron-LM's flag), so that the same steps give the same bits "
        "on a rerun: torch.use_deterministic_algorithms (an op without a deterministic kernel raises, naming "
        "itself), cuDNN deterministic without autotuning, CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA unless already "
        "set, and on the Megatron backend megatron-core's deterministic_mode. Both backends. The engines' side is "
        "vLLM's own (batch-invariant kernels: VLLM_BATCH_INVARIANT=1 in their environment; docs/megatron.md).",
    )
    model_name: str | None = option(
        None,
        "The model's name for converting Megatron weights to HF (the reference's; it picks the converter by name, "
        "and defaults to the name of config.json's class). vime's Megatron backend converts by config.json's "
        "model type, so a name that would pick another model's converter is refused at start-up; the torch "
        "backend's weights are HF's already.",
    )
    megatron_to_hf_mode: str = option(
        "raw",
        "How Megatron weights become HF weights for the engines (the reference's): 'raw' (its own name mapping) or "
        "'bridge' (Megatron-Bridge). vime's Megatron backend converts with its own mapping "
        "(vime/backends/megatron_convert.py) either way; the torch backend's weights are HF's already.",
        choices=["raw", "bridge"],
    )

    def validate(self) -> None:
        for flag, value in self._optimizer_dtypes().items():
            if value == "fp32":
                continue
            # Megatron-LM's rule (OptimizerConfig): other dtypes than fp32 belong to the precision-aware optimizer.
            require(
                self.use_precision_aware_optimizer,
                flag,
                f"{value} needs --use-precision-aware-optimizer (as in Megatron-LM)",
            )
            implemented = flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype") and value == "bf16"
            require(implemented, flag, f"{value} is not implemented in vime: {UNIMPLEMENTED_DTYPES[flag]}")
        # Megatron-LM's rule (validate_args): its CPU optimizer reuses the precision-aware optimizer's code path.
        require(
            not self.optimizer_cpu_offload or self.use_precision_aware_optimizer,
            "--optimizer-cpu-offload",
            "must be used with --use-precision-aware-optimizer (as in Megatron-LM)",
        )
        require(
            0.0 <= self.optimizer_offload_fraction <= 1.0,
            "--optimizer-offload-fraction",
            f"must be in [0, 1], got {self.optimizer_offload_fraction}",
        )
        require(
            self.data_pad_size_multiplier is None or self.data_pad_size_multiplier >= 1,
            "--data-pad-size-multiplier",
            f"must be >= 1 (tokens), got {self.data_pad_size_multiplier}",
        )
        require(
            self.train_memory_margin_bytes >= 0,
            "--train-memory-margin-bytes",
            f"must be >= 0, got {self.train_memory_margin_bytes}",
        )

    def _optimizer_dtypes(self) -> dict[str, str]:
        return {
            "--exp-avg-dtype": self.exp_avg_dtype,
            "--exp-avg-sq-dtype": self.exp_avg_sq_dtype,
            "--main-grads-dtype": self.main_grads_dtype,
            "--main-params-dtype": self.main_params_dtype,
        }

    @property
    def bf16_moments(self) -> bool:
        """AdamW's moments (either) stored in bf16 (vime.backends.adamw_state_dtype)."""
        return "bf16" in (self.exp_avg_dtype, self.exp_avg_sq_dtype)

    def transformer_fields(self) -> dict:
        """The TransformerConfig fields these flags set on the Megatron backend's models (the MoE router's dtype
        travels in MoeOptions: vime sets it itself when the flag is left out)."""
        fields: dict = {}
        if self.attention_softmax_in_fp32:
            fields["attention_softmax_in_fp32"] = True
        if self.deterministic_mode:
            fields["deterministic_mode"] = True
        if self.effective_attention_backend() not in ("auto", "local"):
            # Transformer Engine reads the kernel choice from NVTE_* variables that megatron-core sets from this
            # field when it builds the model; 'local' would switch every TE kernel off under TE's layers.
            from megatron.core.transformer.enums import AttnBackend

            fields["attention_backend"] = AttnBackend[self.effective_attention_backend()]
        return fields

    def check_model_name(self, hf_config) -> None:
        """--model-name must pick the converter the reference would pick for ``hf_config`` by itself (from its
        class's name): vime converts by config.json, so any other name means the script expected another model."""
        if self.model_name is None:
            return
        wanted, actual = reference_converter(self.model_name), reference_converter(type(hf_config).__name__)
        require(
            wanted is not None,
            "--model-name",
            f"{self.model_name!r} names no model the reference converts (its names contain one of "
            f"{', '.join(name for names, _ in REFERENCE_CONVERTERS for name in names)}, '-' and '_' aside)",
        )
        require(
            wanted == actual,
            "--model-name",
            f"{self.model_name!r} picks the {wanted} converter, but --hf-checkpoint's config.json "
            f"({type(hf_config).__name__}) is a {actual or 'model of no converter'}",
        )

    def effective_attention_backend(self) -> str:
        """--attention-backend, or flash where only Megatron-LM's older --use-flash-attn asked for a kernel."""
        return "flash" if self.use_flash_attn and self.attention_backend == "auto" else self.attention_backend

    def router_dtype(self) -> str:
        """The Megatron backend's MoE routing dtype: the flag's, else fp32 (HF's routers compute in float32)."""
        return self.moe_router_dtype or "fp32"

    def startup_notes(self, train_backend: str) -> list[str]:
        """What each flag given here does on ``train_backend``: one line per flag (or group of flags), said
        once at start-up. Flags left at their defaults say nothing."""
        megatron = train_backend == "megatron"
        notes = []
        if self.accumulate_allreduce_grads_in_fp32:
            notes.append(
                "--accumulate-allreduce-grads-in-fp32: already vime's behaviour on both backends (gradients add "
                "up and are summed over ranks in float32, on the float32 masters with --bf16)"
            )
        if self.attention_softmax_in_fp32:
            notes.append(
                "--attention-softmax-in-fp32: the Megatron backend's attention computes masking and softmax in "
                "float32 (set on its TransformerConfig)"
                if megatron
                else "--attention-softmax-in-fp32: no effect on the torch backend (HF's attention chooses its own "
                "softmax precision); it acts with --train-backend megatron"
            )
        if self.use_flash_attn:
            notes.append(
                "--use-flash-attn: no effect on the torch backend, which runs HF's attention"
                if not megatron
                else "--use-flash-attn: taken as --attention-backend flash"
                if self.attention_backend == "auto"
                else f"--use-flash-attn: --attention-backend {self.attention_backend} decides the kernel"
            )
        if self.data_pad_size_multiplier is not None and not megatron:
            notes.append(
                f"--data-pad-size-multiplier {self.data_pad_size_multiplier}: no effect on the torch backend, which "
                "pads nothing for kernel alignment; the Megatron backend pads its micro-batches with it"
            )
        if self.deterministic_mode:
            notes.append(
                "--deterministic-mode: the trainer uses deterministic algorithms only (torch and cuDNN"
                + (", megatron-core's deterministic_mode" if megatron else "")
                + "); the engines' sampling is vLLM's own (VLLM_BATCH_INVARIANT=1 for batch-invariant kernels)"
            )
        if self.seq_length is not None:
            notes.append(
                f"--seq-length {self.seq_length}: not read (RL samples keep their own lengths, bounded by "
                "--rollout-max-response-len; --max-tokens-per-gpu packs them)"
            )
        if self.moe_permute_fusion:
            notes.append(
                "--moe-permute-fusion: vime's Megatron backend builds its models with the fusions off, so the flag "
                "changes nothing" + ("" if megatron else "; the torch backend has no such fusion either")
            )
        if self.attention_backend != "auto":
            if not megatron:
                where = "no effect on the torch backend, which runs HF's attention"
            elif self.attention_backend == "local":
                where = (
                    "megatron-core's own attention, which vime's Megatron backend runs whenever Transformer Engine "
                    "is absent (as on CPU); with Transformer Engine vime builds TE layers, whose kernel TE picks"
                )
            else:
                where = (
                    "Transformer Engine's kernel on the Megatron backend where Transformer Engine is usable (CUDA); "
                    "without it (as on CPU) megatron-core's own attention runs"
                )
            notes.append(f"--attention-backend {self.attention_backend}: {where}")
        if self.moe_router_dtype is not None:
            notes.append(
                f"--moe-router-dtype {self.moe_router_dtype}: the Megatron backend's MoE routers compute in "
                f"{'float64' if self.moe_router_dtype == 'fp64' else 'float32'} (dense models have none)"
                if megatron
                else f"--moe-router-dtype {self.moe_router_dtype}: no effect on the torch backend (HF's MoE routers "
                "compute in float32)"
            )
        fusions = [
            "--" + name.replace("_", "-") for name in FUSION_DESTINATIONS if getattr(self, name)
        ]  # the flags given
        if fusions:
            notes.append(
                f"{', '.join(fusions)}: vime's Megatron backend never uses these fused kernels (it builds its "
                "models with the fusions off on every device), so the flags change nothing"
                + ("" if megatron else "; the torch backend has no such fusions either")
            )
        if self.enable_experimental:
            notes.append(
                "--enable-experimental: megatron-core's experimental flag is set in the Megatron backend's trainers"
                if megatron
                else "--enable-experimental: no effect on the torch backend (megatron-core's experimental features "
                "are the Megatron backend's)"
            )
        offload = [
            flag
            for flag, on in (
                ("--optimizer-cpu-offload", self.optimizer_cpu_offload),
                ("--overlap-cpu-optimizer-d2h-h2d", self.overlap_cpu_optimizer_d2h_h2d),
            )
            if on
        ]
        if offload:
            notes.append(
                f"{', '.join(offload)}: vime's optimizer steps where the trainer's parameters are (on CPU, host memory "
                "already); on GPUs its state is not offloaded during the step (--offload-train moves it to host "
                "memory between steps, --use-distributed-optimizer shards it)"
            )
        if self.use_precision_aware_optimizer and not self.bf16_moments:
            notes.append(
                "--use-precision-aware-optimizer: vime's optimizer is torch's, with float32 master weights and "
                "state (Megatron-LM's default dtypes for this optimizer)"
            )
        if self.train_memory_margin_bytes != 1024**3:
            notes.append(
                f"--train-memory-margin-bytes {self.train_memory_margin_bytes}: vime reserves no margin "
                "(--offload-train moves the trainer's tensors to host memory and back; the engines' share is "
                "--vllm-gpu-memory-utilization)"
            )
        if self.model_name is not None:
            notes.append(
                f"--model-name {self.model_name}: names the model config.json describes (checked); vime converts "
                "by config.json's model type"
                if megatron
                else f"--model-name {self.model_name}: not read by the torch backend (its weights are HF's already)"
            )
        if self.megatron_to_hf_mode != "raw":
            notes.append(
                f"--megatron-to-hf-mode {self.megatron_to_hf_mode}: vime converts Megatron weights with its own "
                "mapping (as 'raw' does)"
                if megatron
                else f"--megatron-to-hf-mode {self.megatron_to_hf_mode}: no effect on the torch backend (its "
                "weights are HF's already)"
            )
        return notes
