# Llama-3.2-3B (SwiGLU, RMSNorm, RoPE base 5e5 with Llama 3 scaling).
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3072
   --ffn-hidden-size 8192
   --vocab-size 128256
   --disable-bias-linear
   --num-attention-heads 24
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --use-rotary-position-embeddings
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 32.0
)
