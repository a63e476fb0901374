"""Argument groups: parsing, forwarding and start-up validation that names the flag."""

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.config.passthrough import split_prefixed, to_cli
from vime.config.vllm import check_against_vllm
from vime.weights.policy import flush_for_sync


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_defaults_and_derived_values(model_dir):
    s = parse_train_args(base(model_dir, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"))
    assert s.global_batch_size == 8
    assert s.cluster.num_engines == 1 and s.cluster.num_trainers == 1
    assert s.max_staleness == 1
    assert s.rollout_data_dir == "/tmp/vime-test-run/rollout_data"
    assert s.weight_dir == "/tmp/vime-test-run/weights"
    assert s.router_args["policy"] == "round_robin"


def test_cuda_is_required_of_this_machine_unless_the_trainer_runs_on_a_ray_cluster(model_dir):
    """A driver on a CPU-only head node may train with Megatron and NCCL on the cluster's GPU nodes (the
    trainer checks its own node); with in-process Ray this machine is where they run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for flags, flag in (
        (["--train-backend", "megatron"], "--train-backend"),
        (["--update-weight-transport", "nccl"], "--update-weight-transport"),
    ):
        with pytest.raises(ConfigError, match=f"^{flag}: .* needs CUDA GPUs"):
            parse_train_args(base(model_dir, *flags))
        assert parse_train_args(base(model_dir, *flags, "--ray-address", "10.0.0.1:6379")).cluster.ray_address


@pytest.mark.parametrize(
    ("driver", "cuda", "megatron_core", "expected"),
    [
        (True, True, True, "megatron"),
        (True, True, False, "torch"),
        (True, False, True, "torch"),  # a driver, but no GPU torch can use
        (False, True, True, "torch"),  # no NVIDIA driver: decided without asking torch
    ],
)
def test_the_default_trainer_is_megatron_where_it_can_run(monkeypatch, driver, cuda, megatron_core, expected):
    """The seeds: vime trains with Megatron-LM; --train-backend megatron is a compatibility option. Megatron
    needs CUDA and megatron-core: without them the default is the torch trainer."""
    import torch

    from vime.config import training

    monkeypatch.setattr(training, "nvidia_driver_present", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(training, "megatron_core_installed", lambda: megatron_core)
    assert training.default_train_backend() == expected


def test_the_run_says_which_trainer_it_chose_when_not_told(model_dir, monkeypatch):
    from vime import preflight

    lines = []
    s = parse_train_args(base(model_dir))
    if s.train.train_backend == "torch":  # this machine: no CUDA GPU (or no megatron-core)
        assert s.backend_by_default and s.args.train_backend == "torch"
        preflight.report_train_backend(s, lines.append)
        assert lines == [
            "training backend: torch (the default on a machine without CUDA GPUs or without megatron-core, "
            "which Megatron needs)"
        ]
    told = parse_train_args(base(model_dir, "--train-backend", "torch"))
    assert told.train.train_backend == "torch" and not told.backend_by_default
    preflight.report_train_backend(told, lines.append)
    assert len(lines) <= 1  # nothing said for a backend the command line chose
    # Where Megatron is the default, its start-up checks apply as if it had been given.
    import vime.config as config

    monkeypatch.setattr(config, "default_train_backend", lambda: "megatron")
    monkeypatch.setattr(config, "check_local_cuda", lambda settings: None)
    both = ("--balance-data", "--use-distributed-optimizer")  # refused on the torch backend only
    assert parse_train_args(base(model_dir, *both)).train.train_backend == "megatron"
    with pytest.raises(ConfigError, match="^--balance-data: cannot be combined with --use-distributed-optimizer"):
        parse_train_args(base(model_dir, *both, "--train-backend", "torch"))


def test_server_concurrency_bounds_the_groups_in_flight(model_dir):
    """The reference's --vllm-server-concurrency (requests per engine in flight) is vime's, not vLLM's: it sets
    how many groups a rollout worker generates at once unless --rollout-max-concurrent-groups says."""
    s = parse_train_args(base(model_dir, "--vllm-server-concurrency", "16", "--n-samples-per-prompt", "4"))
    assert s.cluster.num_engines == 1 and s.rollout.max_concurrent_groups == 4  # 16 requests = 4 groups of 4
    assert not any("server-concurrency" in arg for arg in s.vllm.vllm_args)  # not forwarded to vLLM
    s = parse_train_args(base(model_dir, "--vllm-server-concurrency", "2", "--n-samples-per-prompt", "8"))
    assert s.rollout.max_concurrent_groups == 1  # at least one group
    told = ("--vllm-server-concurrency", "16", "--rollout-max-concurrent-groups", "2")
    assert parse_train_args(base(model_dir, *told)).rollout.max_concurrent_groups == 2
    with pytest.raises(ConfigError, match="^--vllm-server-concurrency: must be >= 1"):
        parse_train_args(base(model_dir, "--vllm-server-concurrency", "0"))


def test_vllm_weight_sync_mode_is_vime_s_and_reload_is_refused(model_dir):
    """The reference's Ascend scripts pass --vllm-weight-sync-mode native: vime's own flag (vLLM has none), never
    forwarded; 'native' and 'auto' are the in-place update vime does, 'reload' is refused naming the flag."""
    assert parse_train_args(base(model_dir)).weights.vllm_weight_sync_mode == "native"
    for mode in ("native", "auto"):
        s = parse_train_args(base(model_dir, "--vllm-weight-sync-mode", mode))
        assert s.weights.vllm_weight_sync_mode == mode
        assert not any("sync-mode" in arg for arg in s.vllm.vllm_args)  # not forwarded to vLLM
    with pytest.raises(ConfigError, match="^--vllm-weight-sync-mode: 'reload' .* not implemented"):
        parse_train_args(base(model_dir, "--vllm-weight-sync-mode", "reload"))
    with pytest.raises(SystemExit):
        parse_train_args(base(model_dir, "--vllm-weight-sync-mode", "hot"))


SFT_ROLLOUT = ("--rollout-function-path", "vime.rollout.sft_rollout.generate_rollout")


def test_debug_train_only_starts_no_engine_and_refuses_what_needs_one(model_dir):
    """--debug-train-only (the reference's SFT scripts): no engine, and a node that joins gets none either."""
    s = parse_train_args(base(model_dir, "--debug-train-only", *SFT_ROLLOUT))
    assert s.cluster.num_engines == 0 and s.args.rollout_num_gpus == 0
    assert s.elastic.rollout_elastic_node_engines is False
    assert parse_train_args(base(model_dir, "--debug-train-only", "--rollout-num-gpus", "0", *SFT_ROLLOUT))
    assert parse_train_args(base(model_dir, *SFT_ROLLOUT)).cluster.num_engines == 1  # without it: as before
    refused = {
        "--rollout-num-gpus asks for 2 engine GPU": ("--rollout-num-gpus", "2"),
        "--colocate shares": ("--colocate",),
        "--rollout-external-engine-addrs attaches": ("--rollout-external-engine-addrs", "127.0.0.1:8000"),
        "--prefill-num-servers describes": ("--prefill-num-servers", "1"),
        "the built-in evaluation": ("--eval-prompt-data", "held_out", "data.jsonl"),
    }
    for reason, flags in refused.items():
        with pytest.raises(ConfigError, match=f"^--debug-train-only: .*{reason}"):
            parse_train_args(base(model_dir, "--debug-train-only", *SFT_ROLLOUT, *flags))
    with pytest.raises(ConfigError, match="^--debug-train-only: .*the built-in rollout generates"):
        parse_train_args(base(model_dir, "--debug-train-only"))
    with pytest.raises(ConfigError, match="^--debug-train-only: cannot be combined with --debug-rollout-only"):
        parse_train_args(base(model_dir, "--debug-train-only", "--debug-rollout-only", *SFT_ROLLOUT))


def test_colocate_is_synchronous(model_dir):
    assert parse_train_args(base(model_dir, "--colocate")).max_staleness == 0


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--advantage-estimator", "magic"], "--advantage-estimator"),
        (["--rollout-top-p", "0"], "--rollout-top-p"),
        (["--global-batch-size", "3"], "--global-batch-size"),
        (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus"),
        (["--save-interval", "2"], "--save-interval"),
        (["--colocate", "--flush-cache-interval", "0"], "--flush-cache-interval"),
        (["--vllm-model", "x"], "--vllm-model"),
        (["--router-port", "1"], "--router-port"),
        (["--router-no-such-flag", "1"], "--router-no-such-flag"),
        (["--num-layers", "3", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--ckpt-step", "3"], "--ckpt-step"),
        # Two data-parallel replicas share each step's micro-batches: 6 is not a multiple of 2 x 2.
        (
            [
                "--actor-num-gpus-per-node",
                "2",
                "--micro-batch-size",
                "2",
                "--rollout-batch-size",
                "3",
                "--n-samples-per-prompt",
                "2",
            ],
            "--global-batch-size",
        ),
        (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),  # the torch backend
        (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size"),
        (["--context-parallel-size", "2"], "--context-parallel-size"),  # the torch backend
        (["--context-parallel-size", "0"], "--context-parallel-size"),
        (["--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline-num-layers"),  # needs PP > 1
        (["--decoder-last-pipeline-num-layers", "0"], "--decoder-last-pipeline-num-layers"),
        (["--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size"),
        (["--expert-tensor-parallel-size", "2", "--actor-num-gpus-per-node", "2"], "--expert-tensor-parallel-size"),
        (["--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"], "--expert-model-parallel-size"),
    ],
)
def test_bad_values_name_the_flag(model_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(base(model_dir, *extra))
    assert str(error.value).startswith(flag), str(error.value)


def test_trainer_ranks_are_data_parallel_replicas_or_megatron_tensor_groups(model_dir):
    from vime.config import check_trainer_parallelism

    s = parse_train_args(
        base(
            model_dir,
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--micro-batch-size",
            "1",
        )
    )
    assert s.cluster.num_trainers == 4
    # Megatron (CUDA only, so its settings are made here): TP must divide the ranks; the rest are replicas.
    s.train.train_backend = "megatron"
    s.megatron.tensor_model_parallel_size = 2
    check_trainer_parallelism(s)  # 2 replicas x micro-batch 1 divides the global batch of 8
    s.train.micro_batch_size = 8
    with pytest.raises(ConfigError, match=r"^--global-batch-size: 8 must be a multiple of --micro-batch-size 8 x 2"):
        check_trainer_parallelism(s)
    s.megatron.tensor_model_parallel_size = 3
    with pytest.raises(ConfigError, match="^--tensor-model-parallel-size: 3 must divide the trainer's 4 rank"):
        check_trainer_parallelism(s)
    # Expert parallelism: the experts of each layer spread over EP ranks (torch_dist checkpoints).
    s.megatron.tensor_model_parallel_size, s.train.micro_batch_size = 1, 1
    s.megatron.expert_model_parallel_size = 4
    check_trainer_parallelism(s)
    for field, value, message in (
        ("expert_model_parallel_size", 3, "^--expert-model-parallel-size: --expert-model-parallel-size 3 x "),
        ("ckpt_format", "torch", "^--ckpt-format: 'torch' cannot hold experts"),
    ):
        setattr(s.megatron, field, value)
        with pytest.raises(ConfigError, match=message):
            check_trainer_parallelism(s)
        s.megatron.expert_model_parallel_size, s.megatron.ckpt_format = 4, "torch_dist"
    # With tensor parallelism, each expert is split over --expert-tensor-parallel-size ranks (default: TP).
    s.megatron.tensor_model_parallel_size = 2
    with pytest.raises(
        ConfigError,
        match="^--expert-model-parallel-size: --expert-model-parallel-size 4 x "
        "--expert-tensor-parallel-size 2 x --pipeline-model-parallel-size 1 must",
    ):
        check_trainer_parallelism(s)
    s.megatron.expert_model_parallel_size = 2
    check_trainer_parallelism(s)
    # Pipeline stages: TP x PP must divide the ranks; the rest are replicas.
    s.megatron.expert_model_parallel_size, s.megatron.pipeline_model_parallel_size = 1, 2
    check_trainer_parallelism(s)  # TP 2 x PP 2: one replica
    s.megatron.pipeline_model_parallel_size = 4
    with pytest.raises(
        ConfigError,
        match=r"^--pipeline-model-parallel-size: 4 x --tensor-model-parallel-size 2 must "
        "divide the trainer's 4 rank",
    ):
        check_trainer_parallelism(s)
    s.megatron.tensor_model_parallel_size, s.megatron.pipeline_model_parallel_size = 1, 2
    s.megatron.expert_model_parallel_size = 2
    check_trainer_parallelism(s)  # 2 stages of 2 ranks, experts spread over both ranks of a stage
    s.megatron.expert_model_parallel_size = 4
    with pytest.raises(
        ConfigError,
        match="^--expert-model-parallel-size: --expert-model-parallel-size 4 x "
        "--expert-tensor-parallel-size 1 x --pipeline-model-parallel-size 2 must",
    ):
        check_trainer_parallelism(s)
    # Expert tensor parallelism: each expert split over ranks (torch_dist checkpoints).
    s.megatron.expert_model_parallel_size, s.megatron.pipeline_model_parallel_size = 1, 1
    s.megatron.expert_tensor_parallel_size = 2
    check_trainer_parallelism(s)
    s.megatron.ckpt_format = "torch"
    with pytest.raises(
        ConfigError,
        match=r"^--ckpt-format: 'torch' cannot hold experts spread over ranks "
        r"\(--expert-tensor-parallel-size 2\)",
    ):
        check_trainer_parallelism(s)
    s.megatron.ckpt_format, s.megatron.tensor_model_parallel_size = "torch_dist", 2
    s.megatron.expert_tensor_parallel_size = 1
    check_trainer_parallelism(s)  # experts whole on each rank of a TP group
    # Context parallelism: TP x PP x CP must divide the ranks; the rest are replicas (--global-batch-size).
    s.megatron.tensor_model_parallel_size, s.megatron.expert_tensor_parallel_size = 1, None
    s.megatron.context_parallel_size = 2
    check_trainer_parallelism(s)  # CP 2 x 2 replicas
    s.megatron.pipeline_model_parallel_size = 4
    with pytest.raises(
        ConfigError,
        match=r"^--context-parallel-size: 2 x --tensor-model-parallel-size 1 x "
        "--pipeline-model-parallel-size 4 must divide the trainer's 4 rank",
    ):
        check_trainer_parallelism(s)
    s.megatron.pipeline_model_parallel_size, s.megatron.expert_model_parallel_size = 1, 2
    check_trainer_parallelism(s)  # the experts spread over the ranks of a context-parallel group
    from vime.config.megatron import MegatronConfig

    with pytest.raises(ConfigError, match=r"^--context-parallel-size: packed \(thd\) sequences are not supported"):
        MegatronConfig(context_parallel_size=2, megatron_packing="thd").validate()


def test_missing_prompt_data_and_model_are_named(tmp_path):
    with pytest.raises(ConfigError, match="^--prompt-data"):
        parse_train_args(["--hf-checkpoint", str(tmp_path), "--rm-type", "f1"])
    with pytest.raises(ConfigError, match="^--hf-checkpoint"):
        parse_train_args(["--hf-checkpoint", str(tmp_path / "nope"), "--prompt-data", "a.jsonl", "--rm-type", "f1"])


def test_prefixed_flags_are_split_out():
    forwarded, rest = split_prefixed(
        [
            "--vllm-max-model-len",
            "64",
            "--lr",
            "1",
            "--vllm-enforce-eager",
            "--vllm-dtype=float32",
            "--vllm-router-port",
            "9",
            "--vllm-seed",
            "-1",
        ],
        "vllm-",
        {"--vllm-router-port"},
    )
    assert forwarded == {"max-model-len": "64", "enforce-eager": None, "dtype": "float32", "seed": "-1"}
    assert rest == ["--lr", "1", "--vllm-router-port", "9"]
    assert to_cli(forwarded) == ["--max-model-len", "64", "--enforce-eager", "--dtype", "float32", "--seed", "-1"]


def test_vllm_flags_are_checked_against_the_installed_vllm():
    check_against_vllm({"max-model-len": "64", "enforce-eager": None})
    with pytest.raises(ConfigError, match="^--vllm-no-such-thing"):
        check_against_vllm({"no-such-thing": "1"})
    with pytest.raises(ConfigError, match="^--vllm-max-model-len: expects a value"):
        check_against_vllm({"max-model-len": None})
    with pytest.raises(ConfigError, match="^--vllm-enforce-eager: is a switch"):
        check_against_vllm({"enforce-eager": "yes"})


@pytest.mark.parametrize(
    "interval, flushes",
    [
        (1, [True, True, True, True, True]),
        (0, [True, False, False, False, False]),
        (-1, [True, False, False, False, False]),
        (2, [True, False, True, False, True]),  # the seeds: keep at version 2, flush at 3, keep at 4
        (3, [True, False, False, True, False]),
    ],
)
def test_flush_cache_interval(interval, flushes):
    assert [flush_for_sync(n, interval) for n in range(1, 6)] == flushes
