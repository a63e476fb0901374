"""What a trainer rank is built from: :class:`TorchTrainerSpec`, the torch backend's settings (the Megatron
backend reads them too, beside its own spec).

Its own module, without torch: the driver builds the spec of every rank (workers/trainer_worker.py) and
would otherwise import torch for it, ~2 CPU-seconds at each `vime train` start.
"""

from __future__ import annotations

import dataclasses

from vime.backends.lr_schedule import LRSchedule
from vime.config.algorithm import AlgorithmConfig
from vime.config.hooks import HooksConfig


@dataclasses.dataclass(kw_only=True)
class TorchTrainerSpec:
    hf_checkpoint: str
    lr: float
    weight_decay: float
    adam_betas: tuple[float, float]
    adam_eps: float
    clip_grad: float
    micro_batch_size: int
    global_batch_size: int
    n_samples_per_prompt: int
    rollout_temperature: float
    algorithm: AlgorithmConfig
    seed: int
    threads: int | None = None
    cpu_affinity: list[int] | None = None  # CPU cores the trainer may use (None: any)
    # The command line's schedule (vime.backends.lr_schedule.lr_schedule_from_settings); None: constant --lr.
    lr_schedule: LRSchedule | None = None
    bf16: bool = False  # --bf16: bf16 model, float32 master weights (docs/real-models.md)
    # The engines' --vllm-dtype (None or "auto": the checkpoint's torch_dtype): the dtype a --bf16 run publishes in.
    engine_dtype: str | None = None
    # --use-distributed-optimizer: FSDP2 over the ranks (torch backend); ZeRO-1 (Megatron, sharded_optimizer.py)
    use_distributed_optimizer: bool = False
    log_probs_chunk_size: int | None = None  # --log-probs-chunk-size: logits by chunks of N tokens (chunked_logits)
    recompute_granularity: str | None = None  # --recompute-granularity: 'full' checkpoints every decoder layer
    # Token budgets (vime.backends.micro_batches, docs/real-models.md): with use_dynamic_batch_size each step's
    # samples are packed into micro-batches of at most max_tokens_per_gpu tokens (not micro_batch_size samples).
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    log_probs_max_tokens_per_gpu: int | None = None  # the no-gradient forwards' budget (None: max_tokens_per_gpu)
    balance_data: bool = False  # --balance-data: data-parallel ranks get a step's micro-batches by token count
    optimizer: str = "adam"  # --optimizer: adam (torch AdamW) or sgd (torch SGD with sgd_momentum)
    # --exp-avg-dtype / --exp-avg-sq-dtype: AdamW's moments' storage dtypes (vime.backends.adamw_state_dtype)
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    sgd_momentum: float = 0.9  # --sgd-momentum
    # Megatron-LM's check, on unless --no-check-for-nan-in-loss-and-grad: a step whose loss or gradient norm is
    # NaN or infinite is not taken and stops the run (rollout_training.NonFiniteStep).
    check_for_nan_in_loss_and_grad: bool = True
    deterministic_mode: bool = False  # --deterministic-mode: deterministic kernels only
    # --custom-convert-samples-to-train-data-path, --save-debug-train-data & co. (vime.config.hooks), and the
    # keys of --custom-config-path: what the objective's user functions see in ``args``.
    hooks: HooksConfig | None = None
    custom_config: dict | None = None
    # Where the models train: "cuda" (this rank's current CUDA device), "cpu", or None: CUDA where this process
    # sees a GPU, else the CPU (training_device). The RL objective's per-token arithmetic stays on the CPU.
    device: str | None = None
