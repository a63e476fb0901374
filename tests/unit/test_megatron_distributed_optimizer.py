"""--use-distributed-optimizer on the Megatron backend (ZeRO-1, vime/backends/sharded_optimizer.py): two gloo ranks
(spawned CPU processes, tests/megatron_shim.py) train the same rollouts with the replicated and with the sharded
optimizer, in float32 and in --bf16; the sharded ranks must take the replicated ranks' steps while each holds half
of the optimizer's state, and their checkpoints must resume on one rank, with and without the flag.

The rollouts have three micro-batches and steps of two and one (tests/unit/test_data_parallel.py), so one rank has
no micro-batch in the second step and still takes part in the sum, the step and the gather. The all-gathers run in
chunks of 1000 elements per rank here, so a chunk ends inside a parameter and a step needs several of them.
"""

import datetime
import glob
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from tests import megatron_shim  # noqa: E402
from tests.gloo_ranks import join_group, leave_group, run_ranks  # noqa: E402
from tests.numerics import ADAMW_WEIGHT_ATOL  # noqa: E402
from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, megatron_spec, trainer_spec  # noqa: E402
from vime.runtime.ports import free_port  # noqa: E402

GROUPS = 3  # x 4 samples = 3 micro-batches of 4; global batch 8: steps of 2 and 1 micro-batches
# float32 trains PPO, so the critic's optimizer is sharded (and checkpointed) too.
ALGORITHM = {
    "float32": {"advantage_estimator": "ppo", "kl_coef": 0.05},
    "bf16": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
}
# Each precision's checkpoint format: both formats carry the gathered (unsharded) optimizer state.
CKPT_FORMAT = {"float32": "torch_dist", "bf16": "torch"}


def sharded_spec(model_dir, precision: str, *, sharded: bool):
    spec = trainer_spec(model_dir, **ALGORITHM[precision])
    spec.use_distributed_optimizer, spec.bf16 = sharded, precision == "bf16"
    return spec


def held_bytes(backend) -> int:
    """Bytes of the actor optimizer's state tensors (moments; not the scalar step counts) and of the weights it
    steps that are not the model's own storage (float32 masters), on this rank."""
    optimizer = backend.actor.optimizer
    state = sum(
        value.numel() * value.element_size()
        for tensors in optimizer.state.values()
        for value in tensors.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    model_storage = {p.untyped_storage().data_ptr() for p in backend.gpt.parameters()}
    masters = sum(
        t.numel() * t.element_size()
        for group in optimizer.param_groups
        for t in group["params"]
        if t.untyped_storage().data_ptr() not in model_storage
    )
    return state + masters


def exported_weights(backend) -> dict[str, torch.Tensor]:
    # Copies: the export may hand out the float32 weights themselves, which the next step changes.
    return {name: tensor.clone() for name, tensor in backend.hf_named_weights()}


def _rank(rank: int, port: int, model_dir: str, work: str) -> None:
    join_group(rank, port, megatron_shim=True, timeout=datetime.timedelta(minutes=2))
    from vime.backends import sharded_optimizer
    from vime.backends.megatron_backend import MegatronBackend

    sharded_optimizer.GATHER_CHUNK_ELEMENTS = 1000
    results = {}
    for precision, fmt in CKPT_FORMAT.items():
        for sharded in (False, True):
            backend = MegatronBackend(
                sharded_spec(model_dir, precision, sharded=sharded),
                megatron_spec(model_dir, ckpt_format=fmt),
            )
            assert backend.dp.size == 2
            initial = exported_weights(backend)
            run = {"metrics": [backend.train_rollout(make_samples(0, GROUPS), 0)]}
            # As TrainerWorker publishes: rank 0 exports, the other rank only takes part (--bf16: in the gather).
            if rank == 0:
                backend.hf_named_weights()
            else:
                backend.export_peer()
            run["weights"], run["initial"] = exported_weights(backend), initial
            run["held_bytes"] = held_bytes(backend)
            run["model_bytes"] = sum(p.numel() * 4 for p in backend.gpt.parameters())  # float32 elements
            if sharded:
                run["optimizer"] = type(backend.optimizer).__name__
                backend.save_training_state(os.path.join(work, f"{precision}_ckpt"))
                run["next"] = backend.train_rollout(make_samples(1, GROUPS), 0)
            results[(precision, sharded)] = run
    torch.save(results, os.path.join(work, f"rank{rank}.pt"))
    leave_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("zero_tiny")))


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("zero_ranks")
    run_ranks(_rank, (free_port(), model_dir, str(work)), 2)
    return work, [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("precision", sorted(CKPT_FORMAT))
def test_sharded_ranks_take_the_replicated_ranks_steps_holding_half_the_state(ranks, precision):
    _, per_rank = ranks
    for results in per_rank:
        replicated, sharded = results[(precision, False)], results[(precision, True)]
        assert sharded["optimizer"] == "ShardedOptimizer"
        for ours, theirs in zip(sharded["metrics"], replicated["metrics"]):
            assert theirs["optimizer_steps"] == 2.0
            assert_same_metrics(ours, theirs)
        assert sharded["weights"].keys() == replicated["weights"].keys()
        for name, tensor in replicated["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)
        # The steps moved the weights by far more than the tolerance: the comparison can fail.
        moved = max(
            float((tensor - replicated["initial"][name]).abs().max()) for name, tensor in replicated["weights"].items()
        )
        assert moved > 10 * ADAMW_WEIGHT_ATOL, moved
    # Memory: AdamW's two float32 moments (and with --bf16 the float32 masters) of every parameter, split in two.
    replicated_bytes = per_rank[0][(precision, False)]["held_bytes"]
    model_bytes = per_rank[0][(precision, False)]["model_bytes"]
    per_element = 12 if precision == "bf16" else 8
    assert replicated_bytes == model_bytes // 4 * per_element
    assert per_rank[1][(precision, False)]["held_bytes"] == replicated_bytes
    held = [results[(precision, True)]["held_bytes"] for results in per_rank]
    assert sum(held) == replicated_bytes  # every element's state on exactly one rank
    for rank_bytes in held:  # halves, up to one element of padding
        assert abs(rank_bytes - replicated_bytes / 2) <= per_element, (held, replicated_bytes)


@pytest.mark.parametrize("precision", sorted(CKPT_FORMAT))
def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one(ranks, model_dir, precision):
    """float32: the torch_dist checkpoint resumes on one rank without the flag; --bf16: the torch-format one on
    one rank with the flag. Either gives the two sharded ranks' next metrics (the order of additions aside)."""
    from vime.backends.megatron_backend import MegatronBackend

    work, per_rank = ranks
    megatron_shim.install()
    bf16 = precision == "bf16"
    resumed = MegatronBackend(
        sharded_spec(model_dir, precision, sharded=bf16), megatron_spec(model_dir, ckpt_format=CKPT_FORMAT[precision])
    )
    resumed.load_training_state(str(work / f"{precision}_ckpt"))
    assert resumed.rollouts_trained == 1
    assert resumed.actor.optimizer_steps == 2
    assert_same_metrics(resumed.train_rollout(make_samples(1, GROUPS), 0), per_rank[0][(precision, True)]["next"])


def test_the_command_line_takes_the_flag_with_and_without_experts_spread_over_ranks(model_dir, tmp_path):
    from tests.train_args import minimal_train_argv
    from vime.config import ConfigError, parse_train_args
    from vime.queue.rollout_queue import StoreOptions
    from vime.workers.trainer_worker import TrainerWorkerSpec

    # Two trainer ranks on a Ray cluster's node (--ray-address: this machine's lack of CUDA is not checked here).
    megatron = ["--train-backend", "megatron", "--ray-address", "10.0.0.1:6379", "--actor-num-gpus-per-node", "2"]
    megatron += ["--micro-batch-size", "1", "--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    # --balance-data is FSDP's (torch backend's) trouble only: the sharded optimizer talks after the backward passes.
    s = parse_train_args(minimal_train_argv(model_dir, *megatron, "--bf16", "--balance-data"))
    spec = TrainerWorkerSpec.from_settings(
        s, transport="object-store", store=StoreOptions(str(tmp_path / "queue")), threads=1, cpu_affinity=None
    )
    assert spec.backend.use_distributed_optimizer and spec.backend.bf16 and spec.megatron is not None
    # Experts spread over ranks: their optimizer is split over the ranks holding the same experts
    # (tests/unit/test_data_parallel.py trains it).
    for flag in ("--expert-model-parallel-size", "--expert-tensor-parallel-size"):
        s = parse_train_args(minimal_train_argv(model_dir, *megatron, flag, "2"))
        assert s.train.use_distributed_optimizer
    with pytest.raises(ConfigError, match="^--balance-data: cannot be combined with --use-distributed-optimizer"):
        parse_train_args(minimal_train_argv(model_dir, "--use-distributed-optimizer", "--balance-data"))


def test_sgd_through_the_sharded_path_and_a_replicated_checkpoint_resumed_sharded(model_dir, tmp_path):
    """--optimizer sgd (its momentum is the state) on one rank: the sharded path takes the replicated optimizer's
    step; a checkpoint written without the flag resumes with it, momentum included (the same next metrics)."""
    from vime.backends.megatron_backend import MegatronBackend

    megatron_shim.install()

    def sgd_backend(sharded: bool) -> MegatronBackend:
        spec = trainer_spec(model_dir)
        spec.optimizer, spec.use_distributed_optimizer = "sgd", sharded
        return MegatronBackend(spec, megatron_spec(model_dir, ckpt_format="torch_dist"))

    replicated, sharded = sgd_backend(False), sgd_backend(True)
    assert_same_metrics(sharded.train_rollout(make_samples(0), 0), replicated.train_rollout(make_samples(0), 0))
    for (name, ours), (_, theirs) in zip(sharded.hf_named_weights(), replicated.hf_named_weights()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=name)
    replicated.save_training_state(str(tmp_path / "ckpt"))
    momentum = [replicated.optimizer.state[p]["momentum_buffer"].clone() for p in replicated.gpt.parameters()]
    after = replicated.train_rollout(make_samples(1), 1)
    resumed = sgd_backend(True)
    resumed.load_training_state(str(tmp_path / "ckpt"))
    # One rank owns every parameter whole: piece i is parameter i, flattened.
    pieces = resumed.optimizer.piece_params
    assert len(pieces) == len(momentum) and any(torch.count_nonzero(m) for m in momentum)
    for piece, saved in zip(pieces, momentum):
        assert torch.equal(resumed.optimizer.state[piece]["momentum_buffer"], saved.flatten())
    assert_same_metrics(resumed.train_rollout(make_samples(1), 1), after)


def moment_dtypes(backend) -> set[torch.dtype]:
    """The dtypes of the actor's AdamW moments: the whole parameters' or, sharded, this rank's pieces'."""
    optimizer = backend.optimizer
    inner = optimizer.optimizer if hasattr(optimizer, "piece_params") else optimizer
    return {v.dtype for state in inner.state.values() for k, v in state.items() if k.startswith("exp_avg")}


@pytest.mark.parametrize("ckpt_format, resume_sharded", [("torch_dist", False), ("torch", True)])
def test_bf16_moments_on_the_megatron_backend_stay_bf16_through_a_checkpoint(
    model_dir, tmp_path, ckpt_format, resume_sharded
):
    """--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 with --train-backend megatron (vime's AdamW steps the Megatron
    backend's parameters too), replicated and sharded on one rank: both take the same step, their moments are
    bf16, and a checkpoint of either format resumes with bf16 moments (not widened to float32 by the load) into
    the continuous run's next step, with or without the sharding."""
    from vime.backends.megatron_backend import MegatronBackend

    megatron_shim.install()

    def backend(sharded: bool) -> MegatronBackend:
        spec = trainer_spec(model_dir)
        spec.exp_avg_dtype = spec.exp_avg_sq_dtype = "bf16"
        spec.use_distributed_optimizer = sharded
        return MegatronBackend(spec, megatron_spec(model_dir, ckpt_format=ckpt_format))

    replicated, sharded = backend(False), backend(True)
    assert_same_metrics(sharded.train_rollout(make_samples(0), 0), replicated.train_rollout(make_samples(0), 0))
    for (name, ours), (_, theirs) in zip(sharded.hf_named_weights(), replicated.hf_named_weights()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=name)
    assert moment_dtypes(replicated) == moment_dtypes(sharded) == {torch.bfloat16}
    sharded.save_training_state(str(tmp_path / "ckpt"))
    if ckpt_format == "torch":  # the sharded state was gathered and written in bf16, not widened to float32
        [saved] = glob.glob(str(tmp_path / "ckpt" / "**" / "model_optim_rng.pt"), recursive=True)
        state = torch.load(saved, map_location="cpu", weights_only=False)["optimizer"]["state"]
        assert {v.dtype for s in state.values() for k, v in s.items() if k.startswith("exp_avg")} == {torch.bfloat16}
    after = sharded.train_rollout(make_samples(1), 1)
    resumed = backend(resume_sharded)
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert moment_dtypes(resumed) == {torch.bfloat16}
    assert_same_metrics(resumed.train_rollout(make_samples(1), 1), after)
