# Qwen3-30B-A3B (MoE: 128 experts, 8 per token, every layer sparse, renormalised top-k weights;
# QK RMSNorm, head dimension 128, RoPE base 1e6).
MODEL_ARGS=(
   --swiglu
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --vocab-size 151936
   --disable-bias-linear
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --qk-layernorm
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --untie-embeddings-and-output-weights

   # MoE
   --num-experts 128
   --moe-router-topk 8
   --moe-ffn-hidden-size 768
   --moe-router-score-function softmax
   --moe-layer-freq "[1]*48"
   --moe-router-load-balancing-type aux_loss
   --moe-aux-loss-coeff 0
   --moe-grouped-gemm
   --moe-token-dispatcher-type alltoall
)
