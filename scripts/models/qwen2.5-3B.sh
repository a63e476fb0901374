# Qwen2.5-3B (Qwen2 architecture: QKV bias, SwiGLU, RMSNorm, RoPE base 1e6).
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2048
   --ffn-hidden-size 11008
   --num-attention-heads 16
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
