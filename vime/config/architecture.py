"""Megatron-LM's flags for attention, activation and vocabulary variants, as the reference's gpt-oss preset passes
them: sliding windows, attention sinks, a clamped "quick" GeGLU, a padded vocabulary, the tokenizer's kind.

vime builds no model from these flags: the torch backend trains HF's implementation of gpt-oss, and vime's
Megatron backend builds none of these variants. Each flag is what the other model flags are in vime, a statement
of --hf-checkpoint's architecture checked against its config.json at start-up (:meth:`ArchitectureConfig.
check_against_hf`), so a preset written for another checkpoint stops the run naming the flag rather than training
a model the script did not describe. A flag left out checks nothing. Names, types and meanings are Megatron-LM's
(``megatron/training/arguments.py``).
"""

from __future__ import annotations

import dataclasses

from vime.config.base import ConfigError, option, require
from vime.config.hf_values import config_value

# HF families whose attention adds a learnt per-head logit to the softmax's denominator ("sinks": Megatron-LM's
# --softmax-type learnable), and whose experts compute the clamped quick GeGLU of gpt-oss:
# (gate * sigmoid(1.702 * gate)) * (up + 1), gate and up clamped at config.json's swiglu_limit.
LEARNABLE_SOFTMAX_FAMILIES = ("gpt_oss",)
QUICK_GEGLU_FAMILIES = ("gpt_oss",)
QUICK_GEGLU_ALPHA = 1.702  # Megatron-LM's quick GeGLU constant (HF gpt-oss: swiglu_alpha)
GLU_LINEAR_OFFSET = {"gpt_oss": 1.0}  # added to the GLU's linear half; 0 in every other family
HF_TOKENIZER = "HuggingFaceTokenizer"


def window_pair(text: str) -> tuple[int, int]:
    """Megatron-LM's --window-size value: LEFT,RIGHT token counts (-1: unbounded)."""
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("--window-size", f"expected LEFT,RIGHT (two integers, e.g. 128,0), got {text!r}") from None
    return left, right


def sliding_window(text_config) -> int | None:
    """config.json's sliding window where some layer uses it (None: none does; Qwen2's configs hold a
    sliding_window that use_sliding_window, or their layer_types, leave unused)."""
    window = config_value(text_config, "sliding_window")
    layer_types = config_value(text_config, "layer_types")
    if layer_types is not None:
        used = "sliding_attention" in layer_types
    else:
        used = config_value(text_config, "use_sliding_window") is not False
    return window if used else None


@dataclasses.dataclass(kw_only=True)
class ArchitectureConfig:
    quick_geglu: bool = option(
        False,
        "The experts' activation is the quick GeGLU, gate * sigmoid(1.702 * gate) (Megatron-LM): gpt-oss's; "
        "checked against --hf-checkpoint's config.json.",
    )
    glu_linear_offset: float | None = option(
        None,
        "A constant added to the GLU's linear half (Megatron-LM; default 0): 1.0 for gpt-oss, whose experts compute "
        "(up + 1); checked against --hf-checkpoint's model type.",
    )
    activation_func_clamp_value: float | None = option(
        None,
        "Clamp of the GLU's inputs (Megatron-LM): gpt-oss's swiglu_limit, checked against config.json.",
    )
    softmax_type: str | None = option(
        None,
        "Attention's softmax (Megatron-LM; default vanilla): 'learnable' adds a learnt per-head term to its "
        "denominator (gpt-oss's attention sinks), 'off-by-one' a constant 1, which no HF model that vime trains "
        "has; checked against --hf-checkpoint's model.",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    window_size: str | None = option(
        None,
        "Sliding-window attention, LEFT,RIGHT tokens (Megatron-LM): RIGHT 0 (causal) and LEFT config.json's "
        "sliding_window, checked.",
        metavar="LEFT,RIGHT",
    )
    window_attn_skip_freq: int | None = option(
        None,
        "Every this-many-th layer attends over the whole sequence, the others in --window-size's window "
        "(Megatron-LM; layers counted from 1): checked against config.json's layer_types.",
    )
    padded_vocab_size: int | None = option(
        None,
        "Rows of the embedding table and the output layer (Megatron-LM): on the torch backend config.json's "
        "vocab_size (HF's table), on the Megatron backend the vocabulary padded to --make-vocab-size-divisible-by "
        "x --tensor-model-parallel-size; checked.",
    )
    tokenizer_type: str | None = option(
        None,
        f"Megatron-LM's tokenizer class. vime tokenizes with --hf-checkpoint's own tokenizer (transformers), "
        f"which is Megatron-LM's {HF_TOKENIZER}; any other type is refused.",
    )

    def validate(self) -> None:
        require(
            self.tokenizer_type in (None, HF_TOKENIZER),
            "--tokenizer-type",
            f"{self.tokenizer_type!r}: vime tokenizes with --hf-checkpoint's tokenizer ({HF_TOKENIZER}) only",
        )
        require(
            self.softmax_type != "off-by-one",
            "--softmax-type",
            "off-by-one: no HF model vime trains adds 1 to attention's softmax denominator (gpt-oss's sinks are "
            "'learnable')",
        )
        if self.window_size is not None:
            left, right = window_pair(self.window_size)
            require(right == 0, "--window-size", f"{left},{right}: HF's sliding windows are causal (RIGHT 0)")
            require(left >= 1, "--window-size", f"{left},{right}: LEFT must be >= 1 token")
        for flag, value in (
            ("--window-attn-skip-freq", self.window_attn_skip_freq),
            ("--padded-vocab-size", self.padded_vocab_size),
        ):
            require(value is None or value >= 1, flag, f"must be >= 1, got {value}")
        require(
            self.activation_func_clamp_value is None or self.activation_func_clamp_value > 0,
            "--activation-func-clamp-value",
            f"must be > 0, got {self.activation_func_clamp_value}",
        )

    def check_against_hf(self, text_config, *, train_backend: str, padded_vocab: int | None) -> None:
        """Each flag given agrees with ``text_config`` (the language model's HF config); ``padded_vocab``: the
        Megatron backend's padded vocabulary (on that backend). Raises ConfigError naming the flag."""
        family = getattr(text_config, "model_type", None)
        self._check_activation(text_config, family)
        if self.softmax_type is not None:
            learnable = family in LEARNABLE_SOFTMAX_FAMILIES
            require(
                (self.softmax_type == "learnable") == learnable,
                "--softmax-type",
                f"{self.softmax_type} disagrees with --hf-checkpoint's {family}, whose attention "
                + ("has learnt sinks (learnable)" if learnable else "is a plain softmax (vanilla)"),
            )
        self._check_windows(text_config)
        if self.padded_vocab_size is not None:
            rows = config_value(text_config, "vocab_size") if train_backend == "torch" else padded_vocab
            require(
                rows is None or self.padded_vocab_size == rows,
                "--padded-vocab-size",
                f"{self.padded_vocab_size} disagrees with the {train_backend} backend's embedding table of {rows} rows"
                + (
                    " (config.json's vocab_size)"
                    if train_backend == "torch"
                    else " (--vocab-size padded to --make-vocab-size-divisible-by x --tensor-model-parallel-size)"
                ),
            )

    def _check_activation(self, text_config, family: str | None) -> None:
        if self.quick_geglu:
            alpha = config_value(text_config, "swiglu_alpha") or QUICK_GEGLU_ALPHA
            require(
                family in QUICK_GEGLU_FAMILIES and abs(alpha - QUICK_GEGLU_ALPHA) < 1e-9,
                "--quick-geglu",
                f"--hf-checkpoint's {family} does not compute the quick GeGLU "
                f"(gate * sigmoid({QUICK_GEGLU_ALPHA} * gate); {', '.join(QUICK_GEGLU_FAMILIES)} does)",
            )
        if self.glu_linear_offset is not None:
            expected = GLU_LINEAR_OFFSET.get(family, 0.0)
            require(
                abs(self.glu_linear_offset - expected) < 1e-9,
                "--glu-linear-offset",
                f"{self.glu_linear_offset} disagrees with --hf-checkpoint's {family} (offset {expected})",
            )
        if self.activation_func_clamp_value is not None:
            limit = config_value(text_config, "swiglu_limit")
            require(
                limit is not None and abs(self.activation_func_clamp_value - limit) < 1e-9,
                "--activation-func-clamp-value",
                f"{self.activation_func_clamp_value} disagrees with --hf-checkpoint's config.json "
                + (f"(swiglu_limit {limit})" if limit is not None else "(no clamp: no swiglu_limit)"),
            )

    def _check_windows(self, text_config) -> None:
        window = sliding_window(text_config)
        if self.window_size is not None:
            require(
                window == window_pair(self.window_size)[0],
                "--window-size",
                f"{self.window_size} disagrees with --hf-checkpoint's config.json "
                + (f"(sliding_window {window})" if window else "(no sliding window)"),
            )
        if self.window_attn_skip_freq is not None:
            layer_types = list(config_value(text_config, "layer_types") or [])
            every = self.window_attn_skip_freq
            expected = [
                "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(len(layer_types))
            ]
            if not layer_types or layer_types != expected:
                raise ConfigError(
                    "--window-attn-skip-freq",
                    f"{every} disagrees with --hf-checkpoint's config.json (layer_types "
                    f"{layer_types[:4] + ['...'] if len(layer_types) > 4 else layer_types})",
                )
