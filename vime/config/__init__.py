"""Command-line arguments of ``vime train``: parsing, typed sections and start-up validation.

Groups: the framework's own flags (``framework``), ``--vllm-*`` (``vllm``), ``--router-*``
(``router``) and the Megatron-style model flags (``megatron``). Components receive their typed
section; user hooks receive the whole ``args`` namespace, as the reference framework's do.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os

from vime.config import router as router_args, vllm as vllm_args
from vime.config.algorithm import AlgorithmConfig
from vime.config.architecture import ArchitectureConfig
from vime.config.base import ConfigError, add_section_arguments, require, section_from_args
from vime.config.checkpoint import CheckpointConfig
from vime.config.elastic import ElasticConfig
from vime.config.evaluation import EvalConfig, resolve_eval_datasets
from vime.config.framework import ClusterConfig, DataConfig, QueueConfig, RolloutConfig
from vime.config.hooks import HooksConfig, load_custom_config
from vime.config.megatron import MegatronConfig
from vime.config.megatron_lm import Passthrough, parse_passthrough, transformer_overrides
from vime.config.megatron_perf import FUSION_DESTINATIONS, MegatronPerfConfig
from vime.config.passthrough import split_prefixed
from vime.config.run import DebugConfig, RunConfig
from vime.config.tracking import TrackingConfig
from vime.config.training import TrainConfig, default_train_backend
from vime.config.weight_sync import WeightSyncConfig
from vime.rl.algorithm_checks import algorithm_engine_args, check_algorithm_with_run

__all__ = ["ConfigError", "TrainSettings", "build_parser", "parse_train_args"]

SECTIONS = [
    ("cluster", ClusterConfig, "Cluster resources"),
    ("data", DataConfig, "Data"),
    ("rollout", RolloutConfig, "Rollout and reward"),
    ("algorithm", AlgorithmConfig, "RL algorithm"),
    ("train", TrainConfig, "Training"),
    ("hooks", HooksConfig, "Custom hooks on samples and training data"),
    ("queue", QueueConfig, "Sample queue"),
    ("weights", WeightSyncConfig, "Weight synchronisation"),
    ("checkpoint", CheckpointConfig, "Checkpoints"),
    ("eval", EvalConfig, "Evaluation"),
    ("run", RunConfig, "Run"),
    ("debug", DebugConfig, "Debug replay"),
    ("elastic", ElasticConfig, "Engine health and elastic rollout"),
    ("tracking", TrackingConfig, "Experiment tracking (wandb, TensorBoard)"),
    ("perf", MegatronPerfConfig, "Megatron-LM kernels, fusions, precision, optimizer offload and memory"),
    ("architecture", ArchitectureConfig, "Megatron-LM attention, activation and vocabulary variants (checked)"),
]


@dataclasses.dataclass(kw_only=True)
class TrainSettings:
    """Every typed section of one ``vime train`` invocation, plus the raw namespace for hooks."""

    cluster: ClusterConfig
    data: DataConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    train: TrainConfig
    hooks: HooksConfig
    queue: QueueConfig
    weights: WeightSyncConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    run: RunConfig
    debug: DebugConfig
    elastic: ElasticConfig
    tracking: TrackingConfig
    perf: MegatronPerfConfig
    architecture: ArchitectureConfig
    vllm: vllm_args.VllmConfig
    router_args: dict
    megatron: MegatronConfig
    args: argparse.Namespace
    megatron_lm: Passthrough = dataclasses.field(default_factory=Passthrough)  # Megatron-LM's own flags given
    backend_by_default: bool = False  # --train-backend not given: chosen by default_train_backend

    @property
    def run_dir(self) -> str:
        return self.run.run_dir  # resolved by finalize()

    @property
    def global_batch_size(self) -> int:
        samples_per_rollout = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if self.train.global_batch_size:
            return self.train.global_batch_size
        return samples_per_rollout // (self.train.num_steps_per_rollout or 1)

    @property
    def rollout_sleep_level(self) -> int:
        """vLLM sleep level of the engines while the trainer trains (0: they do not sleep). Level 2 frees the
        weights too, which a full weight update replaces anyway; a delta needs the weights the engine holds."""
        if not self.cluster.offloads_rollout:
            return 0
        return 1 if self.weights.publishes_deltas else 2

    @property
    def max_staleness(self) -> int:
        if self.queue.max_staleness is not None:
            return self.queue.max_staleness
        return 0 if self.cluster.colocate else 1

    @property
    def rollout_data_dir(self) -> str:
        return self.queue.rollout_data_dir  # resolved by finalize()

    @property
    def weight_dir(self) -> str:
        return self.weights.update_weight_disk_dir  # resolved by finalize()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vime train",
        description="Fully-asynchronous RL post-training: rollout workers generate through vLLM engines behind "
        "vllm-router, a durable straw queue carries accepted groups, trainers update the policy and "
        "publish new weights to the engines.",
        usage="%(prog)s --hf-checkpoint DIR --prompt-data FILE [options]",
        allow_abbrev=False,
    )  # as Megatron-LM's: an abbreviation would take a Megatron-LM flag passed through
    for _, section, title in SECTIONS:
        add_section_arguments(parser, section, title)
    vllm_args.add_help(parser)
    router_args.add_help(parser)
    add_section_arguments(
        parser,
        MegatronConfig,
        "Megatron-style model and parallelism flags",
        "With --train-backend torch these are optional cross-checks of the HF config. "
        "Megatron-LM's other flags are accepted when a Megatron-LM checkout is on PYTHONPATH "
        "(docs/megatron.md).",
    )
    return parser


def parse_train_args(argv: list[str]) -> TrainSettings:
    """Parse and validate; raises ConfigError (naming the flag) or SystemExit for argparse errors."""
    vllm_forwarded, rest = split_prefixed(argv, "vllm-", vllm_args.VIME_OWNED)
    router_forwarded, rest = split_prefixed(rest, "router-", set())
    args, unknown = build_parser().parse_known_args(rest)
    passthrough = parse_passthrough(unknown, args)
    for dest, value in passthrough.values.items():  # hooks see Megatron-LM's flags in ``args`` too
        setattr(args, dest, value)
    # --custom-config-path: its keys become attributes of args (a flag's name overrides the flag), as the
    # reference framework's; before the sections are built, so that an overridden flag acts.
    if getattr(args, "custom_config_path", None):
        args.custom_config_path = _absolute(args.custom_config_path)
        for key, value in load_custom_config(args.custom_config_path).items():
            setattr(args, key, value)
    # The reference framework's names of the --disable-* flags (store_false dests), for hooks reading args.
    args.compute_advantages_and_returns = not args.disable_compute_advantages_and_returns
    args.rewards_normalization = not args.disable_rewards_normalization
    args.check_for_nan_in_loss_and_grad = not args.no_check_for_nan_in_loss_and_grad  # Megatron-LM's dest
    args.vllm_args = vllm_forwarded
    args.router_args = router_forwarded
    sections = {name: section_from_args(cls, args) for name, cls, _ in SECTIONS}
    settings = TrainSettings(
        **sections,
        vllm=vllm_args.VllmConfig(
            vllm_router_ip=args.vllm_router_ip, vllm_router_port=args.vllm_router_port, vllm_args=vllm_forwarded
        ),
        router_args=router_forwarded,
        megatron=section_from_args(MegatronConfig, args),
        args=args,
        megatron_lm=passthrough,
    )
    if settings.train.train_backend is None:  # before the checks: many depend on the backend
        backend = default_train_backend()
        if backend == "megatron" and settings.megatron.names_torch_only_model():
            backend = "torch"  # the script's --spec names a model only the torch backend trains
        settings.train.train_backend = args.train_backend = backend
        settings.backend_by_default = True
    validate(settings)
    finalize(settings)
    return settings


def validate(settings: TrainSettings) -> None:
    for name, _, _ in SECTIONS:
        getattr(settings, name).validate()
    settings.vllm.validate()
    settings.megatron.validate()
    settings.router_args = router_args.resolve_router_args(settings.router_args)
    rollout, cluster = settings.rollout, settings.cluster
    check_steps_per_rollout(settings)  # before anything reads the global batch size it derives
    require(
        settings.global_batch_size % rollout.n_samples_per_prompt == 0,
        "--global-batch-size",
        f"{settings.global_batch_size} must be a multiple of --n-samples-per-prompt {rollout.n_samples_per_prompt}",
    )
    samples_per_rollout = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    require(
        samples_per_rollout % settings.global_batch_size == 0,
        "--global-batch-size",
        f"--rollout-batch-size x --n-samples-per-prompt = {samples_per_rollout} must be a multiple of "
        f"--global-batch-size {settings.global_batch_size}",
    )
    require(
        not (rollout.rollout_group_requests and settings.megatron.use_rollout_routing_replay),
        "--rollout-group-requests",
        "cannot be combined with --use-rollout-routing-replay (the experts are recorded per sample's request)",
    )
    resolve_eval_datasets(settings.eval, rollout, settings.data)  # --eval-config read and checked now
    check_trainer_parallelism(settings)
    check_torch_recompute(settings)
    check_optimizer_state_dtypes(settings)
    check_local_cuda(settings)
    if settings.megatron_lm.values and settings.train.train_backend == "megatron":
        transformer_overrides(settings.megatron_lm)  # a flag setting a field vime decides fails now
    require(
        not (cluster.colocate and settings.weights.flush_cache_interval != 1),
        "--flush-cache-interval",
        "values other than 1 select the fully-async rollout, which cannot run with --colocate",
    )
    check_algorithm_with_run(settings)  # algorithm flags that depend on rollout/model flags
    from vime.backends.lr_schedule import lr_schedule_from_settings

    lr_schedule_from_settings(settings)  # schedule checks that need the run's length or the role file
    settings.vllm.vllm_args.update(algorithm_engine_args(settings))  # score centering's, R3's engine flags
    check_train_only(settings)  # before the topology: --debug-train-only starts no engine
    vllm_args.resolve_topology(settings)  # --vllm-config & co.; sets args.vllm_deployment
    require(
        not (
            getattr(settings.args, "rollout_external_engine_addrs", None)
            and settings.weights.update_weight_transport != "disk"
        ),
        "--update-weight-transport",
        "external engines (--rollout-external-engine-addrs) receive weights from disk; use 'disk'",
    )


def check_train_only(settings: TrainSettings) -> None:
    """--debug-train-only (the reference's): no engine is started, so nothing that needs one may be asked for.
    The run then has no engine (as --rollout-num-gpus 0) and a node that joins gets a rollout worker only."""
    if not settings.debug.debug_train_only:
        return
    args, rollout, cluster = settings.args, settings.rollout, settings.cluster
    external = bool(getattr(args, "rollout_external_engine_addrs", None))
    engine_flags = (
        ("--rollout-num-gpus", bool(cluster.rollout_num_gpus), f"asks for {cluster.rollout_num_gpus} engine GPU(s)"),
        ("--colocate", cluster.colocate, "shares the trainer's GPUs with engines"),
        ("--rollout-external-engine-addrs", external, "attaches engines"),
        ("--vllm-config", bool(getattr(args, "vllm_config", None)), "describes engines"),
        ("--prefill-num-servers", getattr(args, "prefill_num_servers", None) is not None, "describes engines"),
    )
    for flag, given, what in engine_flags:
        require(not given, "--debug-train-only", f"starts no engine, but {flag} {what}")
    require(
        rollout.rollout_function_path is not None or settings.debug.load_debug_rollout_data is not None,
        "--debug-train-only",
        "starts no engine, and the built-in rollout generates with one: give a --rollout-function-path that reads "
        "its samples (e.g. vime.rollout.sft_rollout.generate_rollout) or --load-debug-rollout-data",
    )
    evaluation = settings.eval
    require(
        not (evaluation.eval_prompt_data or evaluation.eval_config) or evaluation.eval_function_path is not None,
        "--debug-train-only",
        "starts no engine, and the built-in evaluation of --eval-prompt-data / --eval-config generates with one "
        "(give an --eval-function-path that does not, or leave the held-out sets out)",
    )
    cluster.rollout_num_gpus = 0
    args.rollout_num_gpus = 0  # hooks read args as the run uses it
    settings.elastic.rollout_elastic_node_engines = False


def check_steps_per_rollout(settings: TrainSettings) -> None:
    """--num-steps-per-rollout K (the reference framework's): the global batch is the rollout's samples / K."""
    steps = settings.train.num_steps_per_rollout
    if steps is None:
        return
    samples = settings.rollout.rollout_batch_size * settings.rollout.n_samples_per_prompt
    require(
        samples % steps == 0,
        "--num-steps-per-rollout",
        f"{steps} must divide --rollout-batch-size x --n-samples-per-prompt = {samples}",
    )
    explicit = settings.train.global_batch_size
    require(
        explicit is None or explicit == samples // steps,
        "--num-steps-per-rollout",
        f"{steps} steps of {samples // steps} samples disagree with --global-batch-size {explicit}; give one of them",
    )


def check_local_cuda(settings: TrainSettings) -> None:
    """Megatron training (megatron-core 0.16 calls torch.cuda in its forward pass) and NCCL weight transfer need
    CUDA GPUs. In-process Ray runs the trainer and the engines on this machine, which must have them. Attached
    to a Ray cluster (--ray-address) they may run on other nodes, under a driver on a CPU-only head node: the
    trainer checks its own node when it starts, naming the flag."""
    if settings.cluster.ray_address:
        return
    if settings.train.train_backend == "megatron":
        import torch

        # vime's tests run megatron-core on CPU through a test-only shim (tests/megatron_shim.py); runs do not.
        require(
            torch.cuda.is_available(),
            "--train-backend",
            "'megatron' needs CUDA GPUs (torch.cuda.is_available() is False here); use --train-backend torch",
        )
    if settings.weights.update_weight_transport == "nccl":
        from vime.weights.nccl import cuda_available

        require(
            cuda_available(),
            "--update-weight-transport",
            "'nccl' needs CUDA GPUs (torch.cuda.is_available() is False here); use 'disk'",
        )


def check_optimizer_state_dtypes(settings: TrainSettings) -> None:
    """AdamW's moments in bf16 (--exp-avg-dtype, --exp-avg-sq-dtype; vime.backends.adamw_state_dtype): an AdamW
    state, built by vime's optimizer on either backend (the Megatron backend steps vime's optimizer too)."""
    perf = settings.perf
    if not perf.bf16_moments:
        return
    flag = "--exp-avg-dtype" if perf.exp_avg_dtype == "bf16" else "--exp-avg-sq-dtype"
    require(
        settings.train.optimizer == "adam", flag, f"bf16 is AdamW's state; --optimizer is {settings.train.optimizer}"
    )


def check_torch_recompute(settings: TrainSettings) -> None:
    """The torch backend's activation checkpointing (vime.backends.activation_checkpointing) is HF's: every
    decoder layer recomputed on its own, i.e. Megatron's ``full`` granularity with ``uniform`` method and one
    layer per group. The Megatron flags that ask for anything else are refused there, not reinterpreted."""
    m = settings.megatron
    if settings.train.train_backend != "torch" or m.recompute_granularity is None:
        return
    require(
        m.recompute_granularity == "full",
        "--recompute-granularity",
        "'selective' (Megatron recomputes the attention core only) has no counterpart on the torch backend; "
        "use 'full' (every decoder layer) or --train-backend megatron",
    )
    require(
        m.recompute_method in (None, "uniform"),
        "--recompute-method",
        f"{m.recompute_method!r}: the torch backend recomputes every decoder layer on its own (uniform, "
        "1 layer per group)",
    )
    require(
        m.recompute_num_layers in (None, 1),
        "--recompute-num-layers",
        f"{m.recompute_num_layers}: the torch backend recomputes every decoder layer on its own (1 per group)",
    )


def check_trainer_parallelism(settings: TrainSettings) -> None:
    """The trainer's ranks (--actor-num-nodes x --actor-num-gpus-per-node) split into tensor-parallel groups,
    pipeline stages and context-parallel groups (Megatron only) and data-parallel replicas; each optimizer
    step's micro-batches are shared by the replicas, so (as in Megatron) --global-batch-size must be a
    multiple of --micro-batch-size x the replicas. Expert parallelism (Megatron, MoE) spreads each layer's
    experts over groups of ranks."""
    ranks, tp = settings.cluster.num_trainers, settings.megatron.tensor_model_parallel_size
    pp = settings.megatron.pipeline_model_parallel_size
    where = f"the trainer's {ranks} rank(s) (--actor-num-nodes x --actor-num-gpus-per-node)"
    if tp > 1:
        require(
            settings.train.train_backend == "megatron",
            "--tensor-model-parallel-size",
            f"{tp} needs --train-backend megatron (the torch backend's ranks are data-parallel replicas)",
        )
        require(ranks % tp == 0, "--tensor-model-parallel-size", f"{tp} must divide {where}")
    if pp > 1:
        require(
            settings.train.train_backend == "megatron",
            "--pipeline-model-parallel-size",
            f"{pp} needs --train-backend megatron",
        )
        require(
            ranks % (tp * pp) == 0,
            "--pipeline-model-parallel-size",
            f"{pp} x --tensor-model-parallel-size {tp} must divide {where}",
        )
    cp = settings.megatron.context_parallel_size
    if cp > 1:
        require(
            settings.train.train_backend == "megatron",
            "--context-parallel-size",
            f"{cp} needs --train-backend megatron",
        )
        require(
            ranks % (tp * pp * cp) == 0,
            "--context-parallel-size",
            f"{cp} x --tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must divide {where}",
        )
    ep = settings.megatron.expert_model_parallel_size
    etp = settings.megatron.expert_tensor_parallel_size or tp
    spread = [("--expert-model-parallel-size", ep)] if ep > 1 else []
    if etp != tp:
        spread.append(("--expert-tensor-parallel-size", etp))
    for flag, size in spread:
        require(settings.train.train_backend == "megatron", flag, f"{size} needs --train-backend megatron")
        require(
            ranks % (ep * etp * pp) == 0,
            flag,
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} x "
            f"--pipeline-model-parallel-size {pp} must divide {where}",
        )
        require(
            settings.megatron.ckpt_format == "torch_dist",
            "--ckpt-format",
            f"'torch' cannot hold experts spread over ranks ({flag} {size}); use torch_dist",
        )
    dynamic = settings.train.use_dynamic_batch_size
    # Expert-parallel ranks exchange tokens in every forward: each must run as many micro-batches as the others.
    # With token budgets the backend makes every pass's count a multiple of the data-parallel ranks, and
    # --balance-data gives each rank the same number (vime.backends.micro_batches); fixed sizes are checked below.
    replicas = ranks // (tp * pp * cp)
    # Experts spread over data-parallel replicas (not only within a tensor-parallel group): tokens cross them.
    exchanging = [(flag, size) for flag, size in spread if flag == "--expert-model-parallel-size" or size > tp]
    require(
        not (exchanging and dynamic) or settings.global_batch_size >= replicas,
        "--global-batch-size",
        f"{settings.global_batch_size} is fewer samples than the {replicas} data-parallel ranks: under "
        f"{exchanging[0][0] if exchanging else ''} {exchanging[0][1] if exchanging else ''} each rank needs a "
        "micro-batch in every optimizer step",
    )
    per_step = settings.train.micro_batch_size * replicas
    # Token budgets pack each step's samples afresh: ranks short of a micro-batch still join the gradient sum.
    require(
        replicas == 1 or dynamic or settings.global_batch_size % per_step == 0,
        "--global-batch-size",
        f"{settings.global_batch_size} must be a multiple of --micro-batch-size {settings.train.micro_batch_size} "
        f"x {replicas} data-parallel replica(s) = {per_step}",
    )


def _absolute(path: str | None) -> str | None:
    """Local paths become absolute: actors of an attached Ray cluster run in other directories."""
    if path is None or "://" in path:
        return path
    return os.path.abspath(path)


def finalize(settings: TrainSettings) -> None:
    """Resolve defaults that depend on other flags (directories), and make local paths absolute."""
    settings.data.prompt_data = _absolute(settings.data.prompt_data)
    settings.train.hf_checkpoint = _absolute(settings.train.hf_checkpoint)
    settings.checkpoint.save = _absolute(settings.checkpoint.save)
    settings.checkpoint.load = _absolute(settings.checkpoint.load)
    settings.eval.eval_config = _absolute(settings.eval.eval_config)
    if settings.eval.eval_prompt_data:
        settings.eval.eval_prompt_data = [
            item if i % 2 == 0 else _absolute(item) for i, item in enumerate(settings.eval.eval_prompt_data)
        ]
    for name in ("prompt_data", "hf_checkpoint", "save", "load", "eval_prompt_data", "eval_config"):
        section = next(getattr(settings, s) for s, cls, _ in SECTIONS if name in cls.__dataclass_fields__)
        setattr(settings.args, name, getattr(section, name))
    rollout = settings.rollout
    if rollout.vllm_server_concurrency and rollout.rollout_max_concurrent_groups is None:
        # The reference's in-flight pool is concurrency x engines requests; vime's workers take whole groups.
        in_flight = rollout.vllm_server_concurrency * max(1, settings.cluster.num_engines)
        rollout.rollout_max_concurrent_groups = max(1, in_flight // rollout.n_samples_per_prompt)
    run = settings.run
    if run.run_dir is None:
        run.run_dir = settings.checkpoint.save or os.path.join(
            "outputs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        )
    run.run_dir = os.path.abspath(run.run_dir)
    queue = settings.queue
    if queue.rollout_data_dir is None:
        base = settings.checkpoint.save or settings.checkpoint.load or run.run_dir
        queue.rollout_data_dir = os.path.join(base, "rollout_data")
    queue.rollout_data_dir = os.path.abspath(queue.rollout_data_dir)
    weights = settings.weights
    if weights.update_weight_disk_dir is None:
        weights.update_weight_disk_dir = os.path.join(run.run_dir, "weights")
    weights.update_weight_disk_dir = os.path.abspath(weights.update_weight_disk_dir)
    tracking = settings.tracking
    tracking.wandb_dir = os.path.abspath(tracking.wandb_dir or run.run_dir)
    args = settings.args
    args.run_dir, args.rollout_data_dir = run.run_dir, queue.rollout_data_dir
    args.wandb_dir = tracking.wandb_dir
    args.update_weight_disk_dir = weights.update_weight_disk_dir
    args.global_batch_size = settings.global_batch_size
    for flag_field, destination in FUSION_DESTINATIONS.items():  # Megatron-LM's names, for hooks reading args
        setattr(args, destination, not getattr(settings.perf, flag_field))
