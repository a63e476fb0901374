# Qwen3-14B (QK RMSNorm, head dimension 128, no QKV bias, RoPE base 1e6).
MODEL_ARGS=(
   --swiglu
   --num-layers 40
   --hidden-size 5120
   --ffn-hidden-size 17408
   --vocab-size 151936
   --disable-bias-linear
   --num-attention-heads 40
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --untie-embeddings-and-output-weights
)
