# Llama-3.2-1B (SwiGLU, RMSNorm, RoPE base 5e5 with Llama 3 scaling).
MODEL_ARGS=(
   --swiglu
   --num-layers 16
   --hidden-size 2048
   --ffn-hidden-size 8192
   --vocab-size 128256
   --disable-bias-linear
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 64
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --use-rotary-position-embeddings
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 32.0
)
