# Qwen2.5-0.5B (Qwen2 architecture: QKV bias, SwiGLU, RMSNorm, RoPE base 1e6).
MODEL_ARGS=(
   --swiglu
   --num-layers 24
   --hidden-size 896
   --ffn-hidden-size 4864
   --num-attention-heads 14
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --vocab-size 151936
)
