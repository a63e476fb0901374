# vime's tiny Llama: `vime tools make-tiny-model OUT --arch llama` (12-token character vocabulary).
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 128
   --ffn-hidden-size 256
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 12
)
