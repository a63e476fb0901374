# A tiny Qwen3 (QK-norm, head dimension 32 independent of the hidden size), e.g.
#   AutoConfig.for_model("qwen3", vocab_size=12, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
#                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
#                        tie_word_embeddings=False)
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 128
   --ffn-hidden-size 256
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --qk-layernorm
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 12
)
