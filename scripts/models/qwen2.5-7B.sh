# Qwen2.5-7B (Qwen2 architecture: QKV bias, SwiGLU, RMSNorm, RoPE base 1e6).
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --vocab-size 152064
   --untie-embeddings-and-output-weights
)
