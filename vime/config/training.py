"""The trainer's flags: backend, precision, batching, optimizer and learning-rate schedule.

Flag names and meanings follow the reference usage guide; vime-specific additions say so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from vime.config.base import option, require


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    train_backend: str | None = option(
        None,
        "Training backend. 'megatron' trains a megatron-core GPTModel built from the Megatron flags (Qwen2, "
        "Qwen3, Llama and their MoE variants; needs megatron-core and CUDA; see docs/megatron.md); 'torch' "
        "trains the HF model from --hf-checkpoint (FSDP2; the one for machines without GPUs). Default: "
        "megatron where this machine has CUDA GPUs and megatron-core (the reference framework's backend), "
        "torch otherwise; the start-up output says which.",
        choices=["torch", "megatron"],
    )
    hf_checkpoint: str | None = option(
        None,
        "HF model folder: version 0 of the weights, the engines' model "
        "and (torch backend) the trainer's initial weights.",
    )
    num_rollout: int = option(100, "Number of training rollouts (each ends with a weight synchronisation).")
    global_batch_size: int | None = option(
        None, "Samples per optimizer step (default: --rollout-batch-size x --n-samples-per-prompt)."
    )
    micro_batch_size: int = option(64, "Samples per forward/backward pass (without --use-dynamic-batch-size).")
    use_dynamic_batch_size: bool = option(
        False,
        "Split each optimizer step's samples into micro-batches by token count (at most --max-tokens-per-gpu "
        "tokens each) instead of --micro-batch-size samples; the loss does not depend on the packing "
        "(docs/real-models.md).",
    )
    max_tokens_per_gpu: int | None = option(
        None,
        "With --use-dynamic-batch-size: the most tokens (prompt + response) of one training micro-batch on one "
        "GPU (Megatron context parallelism: x --context-parallel-size per micro-batch). A longer sample trains in a "
        "micro-batch of its own, with a warning.",
    )
    log_probs_max_tokens_per_gpu: int | None = option(
        None,
        "With --use-dynamic-batch-size: the token budget of the no-gradient forwards (old and reference "
        "log-probs, critic values). Default: --max-tokens-per-gpu.",
    )
    balance_data: bool = option(
        False,
        "Give the data-parallel ranks each optimizer step's micro-batches by token count (largest first, to "
        "the rank with the fewest tokens) instead of round-robin.",
    )
    num_steps_per_rollout: int | None = option(
        None,
        "Optimizer steps per rollout: --global-batch-size becomes --rollout-batch-size x --n-samples-per-prompt / N.",
    )
    lr: float = option(1e-6, "Learning rate: the peak of the schedule (--lr-decay-style).")
    lr_decay_style: str = option(
        "constant",
        "Learning-rate schedule after the warmup, as Megatron's: 'constant' (--lr), 'linear' or 'cosine' "
        "(from --lr down to --min-lr at --lr-decay-iters), 'inverse-square-root', or 'WSD' (constant, then the last "
        "--lr-wsd-decay-iters anneal). An iteration is one optimizer step. Megatron's default is 'linear'; vime's "
        "keeps the rate constant unless asked.",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_decay_iters: int | None = option(
        None,
        "Optimizer steps over which the learning rate decays, warmup included; afterwards it is --min-lr "
        "(default: the run's steps, --num-rollout x the optimizer steps of one rollout).",
    )
    lr_warmup_iters: int = option(0, "Optimizer steps of linear warmup from --lr-warmup-init to --lr.")
    lr_warmup_fraction: float | None = option(
        None, "Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."
    )
    lr_warmup_init: float = option(0.0, "Learning rate of the first warmup step.")
    min_lr: float = option(
        0.0, "Learning rate the decay ends at (PPO's critic: scaled to its role's lr unless its role sets min_lr)."
    )
    lr_wsd_decay_style: str = option(
        "exponential", "Annealing of --lr-decay-style WSD.", choices=["exponential", "linear", "cosine", "minus_sqrt"]
    )
    lr_wsd_decay_iters: int | None = option(
        None, "With --lr-decay-style WSD: the last optimizer steps of --lr-decay-iters, which anneal to --min-lr."
    )
    optimizer: str = option(
        "adam",
        "Optimizer (Megatron-LM's flag): 'adam' is torch's AdamW (decoupled weight decay, as Megatron's adam), "
        "'sgd' torch's SGD with --sgd-momentum and --weight-decay (L2, as Megatron's sgd); both backends. "
        "Megatron-LM's 'muon' and 'dist_muon' are not implemented in vime.",
        choices=["adam", "sgd", "muon", "dist_muon"],
    )
    sgd_momentum: float = option(0.9, "Momentum factor of --optimizer sgd (Megatron-LM's flag).")
    weight_decay: float = option(0.0, "Weight decay: AdamW's decoupled decay, or SGD's L2 term.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    clip_grad: float = option(1.0, "Gradient-norm clip (0 disables).")
    train_threads: int | None = option(
        None, "Torch threads of each trainer on CPU (default: its share of cores). vime-specific."
    )
    bf16: bool = option(
        False,
        "Train in bfloat16: bf16 parameters and activations, float32 master weights and "
        "optimizer state, loss and log-probs in float32 (docs/real-models.md).",
    )
    use_distributed_optimizer: bool = option(
        False,
        "Shard the training state across the trainer's data-parallel ranks. Torch backend: FSDP2 shards the "
        "parameters, gradients and optimizer state. Megatron backend: the optimizer state and, with --bf16, the "
        "float32 master weights (ZeRO-1, as Megatron's distributed optimizer; routed experts spread over ranks "
        "are split over the ranks holding the same experts) (docs/real-models.md).",
    )
    no_check_for_nan_in_loss_and_grad: bool = option(
        False,
        "Train on when an optimizer step's loss or gradient norm is NaN or infinite (Megatron-LM's flag). By "
        "default such a step is not taken and the run stops with one line naming it, before the rollout is "
        "committed, so that no NaN reaches the weights, the engines or a checkpoint.",
    )
    log_probs_chunk_size: int | None = option(
        None,
        "Compute log-probs and entropy over N tokens at a time (LM head, temperature, log-softmax by chunks, "
        "recomputed in the backward pass), so a micro-batch's whole [tokens x vocabulary] logits are never held; "
        "same results and gradients. Both backends; on the Megatron backend the output layer's vocabulary-parallel "
        "logits are gathered a chunk at a time (docs/real-models.md). Default: all tokens at once.",
    )

    def validate(self) -> None:
        require(bool(self.hf_checkpoint), "--hf-checkpoint", "is required (an HF model folder)")
        require(
            os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")),
            "--hf-checkpoint",
            f"{self.hf_checkpoint!r} is not an HF model folder (no config.json)",
        )
        if self.train_backend == "megatron":
            require(
                megatron_core_installed(),
                "--train-backend",
                "'megatron' needs megatron-core (pip install megatron-core==0.16.1)",
            )
            # CUDA: vime.config.check_local_cuda (this machine's, unless the trainer runs on a Ray cluster's).
        require(
            self.optimizer in ("adam", "sgd"),
            "--optimizer",
            f"{self.optimizer!r} (Megatron-LM's Muon) is not implemented in vime; use adam or sgd",
        )
        require(self.sgd_momentum >= 0, "--sgd-momentum", f"must be >= 0, got {self.sgd_momentum}")
        require(self.num_rollout >= 1, "--num-rollout", "must be >= 1")
        require(self.lr > 0, "--lr", "must be > 0")
        self._validate_lr_schedule()
        require(self.micro_batch_size >= 1, "--micro-batch-size", "must be >= 1")
        if self.log_probs_chunk_size is not None:
            require(
                self.log_probs_chunk_size >= 1,
                "--log-probs-chunk-size",
                f"must be >= 1 (tokens per chunk), got {self.log_probs_chunk_size}",
            )
        require(self.global_batch_size is None or self.global_batch_size >= 1, "--global-batch-size", "must be >= 1")
        self._validate_token_budgets()

    def _validate_token_budgets(self) -> None:
        """--use-dynamic-batch-size and its budgets (vime.backends.micro_batches)."""
        for flag, value in (
            ("--max-tokens-per-gpu", self.max_tokens_per_gpu),
            ("--log-probs-max-tokens-per-gpu", self.log_probs_max_tokens_per_gpu),
        ):
            if value is not None:
                require(value >= 1, flag, f"must be >= 1 (tokens per micro-batch), got {value}")
                require(self.use_dynamic_batch_size, flag, "has no effect without --use-dynamic-batch-size")
        if self.use_dynamic_batch_size:
            require(
                self.max_tokens_per_gpu is not None,
                "--max-tokens-per-gpu",
                "is required with --use-dynamic-batch-size (the token budget of a micro-batch)",
            )
        # FSDP keeps its ranks' passes in lock step by counting round-robin shares (vime/backends/fsdp.py); the
        # Megatron backend's sharded optimizer communicates only after the backward passes.
        require(
            not (self.balance_data and self.use_distributed_optimizer and self.train_backend == "torch"),
            "--balance-data",
            "cannot be combined with --use-distributed-optimizer on the torch backend yet (FSDP's ranks share "
            "micro-batches round-robin)",
        )
        require(
            self.num_steps_per_rollout is None or self.num_steps_per_rollout >= 1,
            "--num-steps-per-rollout",
            "must be >= 1",
        )

    def _validate_lr_schedule(self) -> None:
        """Megatron's rules for the schedule flags; the ones that need the run's step count are checked
        where the schedule is built (vime.backends.lr_schedule.schedule_from_flags)."""
        require(0 <= self.min_lr <= self.lr, "--min-lr", f"must be in [0, --lr {self.lr:g}], got {self.min_lr:g}")
        require(
            0 <= self.lr_warmup_init <= self.lr,
            "--lr-warmup-init",
            f"must be in [0, --lr {self.lr:g}], got {self.lr_warmup_init:g}",
        )
        require(self.lr_warmup_iters >= 0, "--lr-warmup-iters", "must be >= 0")
        if self.lr_warmup_fraction is not None:
            require(
                self.lr_warmup_iters == 0,
                "--lr-warmup-fraction",
                "give --lr-warmup-iters or --lr-warmup-fraction, not both",
            )
            require(0 <= self.lr_warmup_fraction < 1, "--lr-warmup-fraction", "must be in [0, 1)")
        if self.lr_decay_iters is not None:
            require(self.lr_decay_iters >= 1, "--lr-decay-iters", "must be >= 1")
            require(
                self.lr_warmup_iters < self.lr_decay_iters,
                "--lr-decay-iters",
                f"{self.lr_decay_iters} must be more than --lr-warmup-iters {self.lr_warmup_iters}",
            )
        if self.lr_decay_style == "WSD":
            require(
                self.lr_wsd_decay_iters is not None, "--lr-wsd-decay-iters", "is required with --lr-decay-style WSD"
            )
            require(self.lr_wsd_decay_iters >= 1, "--lr-wsd-decay-iters", "must be >= 1")
            require(
                self.lr_decay_iters is None or self.lr_wsd_decay_iters <= self.lr_decay_iters,
                "--lr-wsd-decay-iters",
                f"{self.lr_wsd_decay_iters} is more than --lr-decay-iters {self.lr_decay_iters}",
            )
        else:
            require(
                self.lr_wsd_decay_iters is None, "--lr-wsd-decay-iters", "has no effect without --lr-decay-style WSD"
            )


def megatron_core_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no `megatron` package at all
        return False


def nvidia_driver_present() -> bool:
    """Whether this machine shows an NVIDIA driver (its GPUs in /proc, a device node, nvidia-smi): cheap, so that a
    CPU machine decides without importing torch (flag errors stay fast)."""
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return True
    except OSError:
        pass
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def default_train_backend() -> str:
    """The backend a run without --train-backend trains with: the reference framework's, Megatron, where it can
    run (CUDA GPUs on this machine and megatron-core installed), else torch. A driver attached to a Ray
    cluster (--ray-address) decides by its own machine: on a CPU-only head node, give --train-backend megatron."""
    if not nvidia_driver_present() or not megatron_core_installed():
        return "torch"
    import torch

    return "megatron" if torch.cuda.is_available() else "torch"
