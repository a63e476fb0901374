# A tiny Qwen3-MoE (4 experts, 2 per token, renormalised top-k weights; QK-norm), as the tests build it
# (tests/megatron_shim.py: tiny_moe_hf_model), e.g.
#   AutoConfig.for_model("qwen3_moe", vocab_size=16, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
#                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
#                        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 32
   --ffn-hidden-size 48
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 16
   --qk-layernorm
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 16
   --num-experts 4
   --moe-router-topk 2
   --moe-ffn-hidden-size 24
   --moe-layer-freq 1
)
