# Llama-3.1-8B (SwiGLU, RMSNorm, RoPE base 5e5 with Llama 3 scaling).
MODEL_ARGS=(
   --swiglu
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --vocab-size 128256
   --disable-bias-linear
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --use-rotary-position-embeddings
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 8.0
   --untie-embeddings-and-output-weights
)
