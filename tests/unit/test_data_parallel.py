"""Several ranks over gloo (spawned CPU processes): the ranks take the steps one rank takes.

Each backend trains the same rollouts in one process and on two data-parallel ranks; the metrics and the
updated weights must agree (only the order of floating-point additions differs). The rollouts have three
micro-batches and two per optimizer step, so in the second step one rank has no micro-batch at all and must
still take part in the gradient sum. Only rank 0 writes checkpoints and weights.
"""

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
from vime.runtime.ports import free_port  # noqa: E402

GROUPS = 3  # x 4 samples = 3 micro-batches of 4; global batch 8: steps of 2 and 1 micro-batches
TORCH_RUNS = {
    "kl_loss_entropy": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
    "ppo": {"advantage_estimator": "ppo", "kl_coef": 0.05},
}


def _rank(
    rank: int,
    port: int,
    model_dir: str,
    work: str,
    backend_name: str,
    world: int = 2,
    layouts: dict[str, dict] | None = None,
) -> None:
    join_group(rank, port, world, megatron_shim=backend_name.startswith("megatron"))
    from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec

    results = {}
    if backend_name == "torch":
        from vime.backends.torch_backend import TorchBackend

        for name, algorithm in TORCH_RUNS.items():
            backend = TorchBackend(trainer_spec(model_dir, **algorithm))
            assert backend.dp.size == 2 and backend.dp.rank == rank
            metrics = [backend.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
            folder = os.path.join(work, f"{name}_ckpt_rank{rank}")
            backend.save_training_state(folder)
            results[name] = {
                "metrics": metrics,
                "wrote_checkpoint": os.path.isdir(folder),
                "weights": {n: p.detach().clone() for n, p in backend.model.named_parameters()},
            }
    elif backend_name == "megatron":
        from vime.backends.megatron_backend import MegatronBackend

        backend = MegatronBackend(trainer_spec(model_dir, **TORCH_RUNS["kl_loss_entropy"]), megatron_spec(model_dir))
        assert backend.dp.size == 2
        metrics = [backend.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
        backend.save_training_state(os.path.join(work, "megatron_ckpt"))  # every rank: one torch_dist checkpoint
        results["megatron"] = {"metrics": metrics, "weights": dict(backend.hf_named_weights())}
    elif backend_name == "megatron_pp":  # two pipeline stages of one layer each, embeddings tied across them
        from vime.backends.megatron_backend import MegatronBackend
        from vime.backends.megatron_model import Parallelism

        for name, algorithm in TORCH_RUNS.items():
            backend = MegatronBackend(
                trainer_spec(model_dir, **algorithm), megatron_spec(model_dir, parallel=Parallelism(pipeline=2))
            )
            assert backend.pipeline.rank == rank and len(backend.gpt.decoder.layers) == 1
            metrics = [backend.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
            backend.save_training_state(os.path.join(work, f"pp_{name}_ckpt"))
            backend.save_weights(os.path.join(work, f"pp_{name}_weights"))  # the first stage writes
            results[name] = {"metrics": metrics, "weights": dict(backend.hf_named_weights())}
        # Three layers split unevenly: one in the first stage, two in the last.
        uneven = os.path.join(work, "tied3")
        backend = MegatronBackend(
            trainer_spec(uneven, **TORCH_RUNS["kl_loss_entropy"]),
            megatron_spec(uneven, parallel=Parallelism(pipeline=2, first_stage_layers=1)),
        )
        assert len(backend.gpt.decoder.layers) == 1 + rank
        results["uneven"] = {
            "metrics": [backend.train_rollout(make_samples(0, GROUPS), 0)],
            "weights": dict(backend.hf_named_weights()),
        }
        # An MoE model whose recorded routes (R3) each stage replays in its own layers, with the aux loss.
        from tests.unit.test_megatron_moe_r3 import make_samples as routed_samples

        backend = MegatronBackend(*_routed_specs(os.path.join(work, "moe"), Parallelism(pipeline=2)))
        results["moe_r3"] = {
            "metrics": [backend.train_rollout(routed_samples(seed, routes=True), 0) for seed in (0, 1)]
        }
    elif backend_name == "megatron_layout":  # a dense model in layouts of ``Parallelism`` fields, one after another
        from tests.unit.test_megatron_moe_r3 import make_samples as routed_samples
        from vime.backends.megatron_backend import MegatronBackend
        from vime.backends.megatron_model import Parallelism

        for layout_id, layout in layouts.items():
            for name, algorithm in TORCH_RUNS.items():
                backend = MegatronBackend(
                    trainer_spec(model_dir, **algorithm), megatron_spec(model_dir, parallel=Parallelism(**layout))
                )
                metrics = [backend.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
                backend.save_training_state(os.path.join(work, f"{layout_id}_{name}_ckpt"))
                results[f"{layout_id}/{name}"] = {"metrics": metrics, "weights": dict(backend.hf_named_weights())}
            # MoE with recorded routes (R3) and the aux loss
            backend = MegatronBackend(*_routed_specs(os.path.join(work, "moe"), Parallelism(**layout)))
            results[f"{layout_id}/moe_r3"] = {
                "metrics": [backend.train_rollout(routed_samples(seed, routes=True), 0) for seed in (0, 1)]
            }
            _reset_megatron()
    else:  # experts spread (EP: 2 of the 4 on each rank) and maybe split (ETP) over ranks, in stages or TP groups
        import dataclasses

        from vime.backends.megatron_backend import MegatronBackend
        from vime.backends.megatron_model import Parallelism
        from vime.backends.megatron_weights import local_expert_count

        for layout_id, layout in layouts.items():
            layout = dict(layout)
            trainer = dataclasses.replace(
                trainer_spec(model_dir, **TORCH_RUNS["kl_loss_entropy"]), **layout.pop("trainer", {})
            )
            parallel = Parallelism(**layout)
            backend = MegatronBackend(trainer, megatron_spec(model_dir, parallel=parallel))
            assert local_expert_count(backend.gpt) == 4 // parallel.expert and backend.dp.size == 2
            assert len(backend.gpt.decoder.layers) == 2 // parallel.pipeline
            fc1 = next(
                p for n, p in backend.gpt.named_parameters() if n.endswith("experts.local_experts.0.linear_fc1.weight")
            )
            assert fc1.shape[0] == 2 * backend.megatron.model.moe_ffn_hidden_size // parallel.expert_tensor_size
            # Two groups: one micro-batch per rank per step, of different lengths (the ranks pad to agree).
            metrics = [backend.train_rollout(make_samples(seed), 0) for seed in (0, 1)]
            backend.save_training_state(os.path.join(work, f"{layout_id}_ckpt"))
            results[layout_id] = {"metrics": metrics, "weights": dict(backend.hf_named_weights())}
            if trainer.use_distributed_optimizer:
                results[layout_id]["sharding"] = _sharding(backend)
            _reset_megatron()
    torch.save(results, os.path.join(work, f"{backend_name}_rank{rank}.pt"))
    leave_group()


def _sharding(backend) -> dict[str, int]:
    """What this rank's sharded optimizer holds (AdamW's first-moment elements) and what it would hold split
    evenly: the dense parameters' elements over the data x context parallel ranks, the routed experts' over the
    ranks that hold the same experts."""
    from vime.backends.megatron_weights import is_expert_param

    optimizer = backend.actor.optimizer
    expert = sum(p.numel() for name, p in backend.gpt.named_parameters() if is_expert_param(name))
    return {
        "moments": sum(state["exp_avg"].numel() for state in optimizer.state.values()),
        "dense": sum(p.numel() for p in backend.gpt.parameters()) - expert,
        "expert": expert,
        "dense_ranks": backend.gradient_dp.size,
        "expert_ranks": backend.expert_dp.size,
    }


def _reset_megatron() -> None:
    """Tear megatron-core's parallel state down, so that the next layout sets its own up in the same processes
    (one set of processes for several layouts: starting four processes costs more than a layout's steps)."""
    import gc

    from megatron.core import parallel_state as ps

    gc.collect()
    ps.destroy_model_parallel()


def _routed_specs(moe_dir: str, parallel):
    from tests.unit.test_megatron_backend import megatron_spec, trainer_spec
    from vime.backends.megatron_model import MoeOptions

    return (
        trainer_spec(moe_dir, **TORCH_RUNS["kl_loss_entropy"]),
        megatron_spec(moe_dir, parallel=parallel, moe=MoeOptions(routing_replay=True, aux_loss_coeff=0.01)),
    )


def _spawn_ranks(
    backend_name: str, model_dir: str, work: str, world: int = 2, layouts: dict[str, dict] | None = None
) -> list[dict]:
    run_ranks(_rank, (free_port(), model_dir, work, backend_name, world, layouts), world)
    return [torch.load(os.path.join(work, f"{backend_name}_rank{r}.pt"), weights_only=False) for r in range(world)]


def _assert_ranks_took_the_steps(ranks: list[dict], key: str, expected: list[dict]) -> None:
    """Every rank's metrics of rollouts 0 and 1 (under ``key``) equal the reference's (``expected``)."""
    from tests.unit.test_megatron_backend import assert_same_metrics

    for seed, reference in enumerate(expected):
        for rank in ranks:
            assert_same_metrics(rank[key]["metrics"][seed], reference)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("dp_tiny")))


def test_torch_backend_two_ranks_take_one_ranks_steps(model_dir, tmp_path):
    from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, trainer_spec
    from vime.backends.torch_backend import TorchBackend

    ranks = _spawn_ranks("torch", model_dir, str(tmp_path))
    for name, algorithm in TORCH_RUNS.items():
        single = TorchBackend(trainer_spec(model_dir, **algorithm))
        for seed, got in zip((0, 1), ranks[0][name]["metrics"]):
            expected = single.train_rollout(make_samples(seed, GROUPS), 0)
            assert expected["optimizer_steps"] == 2.0
            assert_same_metrics(got, expected)
            assert_same_metrics(ranks[1][name]["metrics"][seed], expected)
        for param_name, param in single.model.named_parameters():
            for rank in ranks:  # both replicas stay equal to the single rank's model
                torch.testing.assert_close(
                    rank[name]["weights"][param_name], param.detach(), rtol=0, atol=1e-6, msg=f"{name}: {param_name}"
                )
        assert ranks[0][name]["wrote_checkpoint"] and not ranks[1][name]["wrote_checkpoint"]


def test_megatron_backend_two_data_parallel_ranks_take_one_ranks_steps(model_dir, tmp_path):
    from tests.unit.test_megatron_backend import assert_same_weights, make_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.torch_backend import TorchBackend

    ranks = _spawn_ranks("megatron", model_dir, str(tmp_path))
    megatron_shim.install()
    reference = TorchBackend(trainer_spec(model_dir, **TORCH_RUNS["kl_loss_entropy"]))
    _assert_ranks_took_the_steps(
        ranks, "megatron", [reference.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
    )
    for rank in ranks:
        for name, param in reference.model.named_parameters():
            torch.testing.assert_close(
                rank["megatron"]["weights"][name], param.detach(), rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name
            )
    # The two replicas wrote one torch_dist checkpoint; one process resumes from it.
    resumed = MegatronBackend(trainer_spec(model_dir, **TORCH_RUNS["kl_loss_entropy"]), megatron_spec(model_dir))
    resumed.load_training_state(str(tmp_path / "megatron_ckpt"))
    assert resumed.rollouts_trained == 2
    assert_same_weights(resumed, reference.model)


# Four processes, expert parallelism 2 (each rank holds half of the experts) in every layout.
EXPERT_LAYOUTS = {
    "ep2_pp2": {"expert": 2, "pipeline": 2},  # in each of two stages
    "ep2_tp2_sp": {"expert": 2, "tensor": 2, "sequence_parallel": True},  # experts split over TP ranks
    "ep2_tp2_sp_etp1": {"expert": 2, "tensor": 2, "expert_tensor": 1, "sequence_parallel": True},  # ... or whole
    "ep2_cp2": {"expert": 2, "context": 2},  # over context-parallel ranks
    # Token budgets and --balance-data: each step's micro-batches (and the forwards') split to an even count,
    # each rank given as many as the other, balanced by tokens (vime.backends.micro_batches).
    "ep2_tp2_sp_budgets": {
        "expert": 2,
        "tensor": 2,
        "sequence_parallel": True,
        "trainer": {
            "use_dynamic_batch_size": True,
            # Three micro-batches each pass by these budgets, split to four (so the ranks run two each).
            "max_tokens_per_gpu": 25,
            "log_probs_max_tokens_per_gpu": 30,
            "balance_data": True,
        },
    },
    # --use-distributed-optimizer: the dense parameters' optimizer split over the four data x context parallel
    # ranks, the experts' over the two ranks holding the same experts; under TP 2 (experts split over the TP
    # ranks, so no rank shares its experts' shards) over two and one.
    "ep2_cp2_zero1": {"expert": 2, "context": 2, "trainer": {"use_distributed_optimizer": True}},
    "ep2_tp2_sp_zero1": {
        "expert": 2,
        "tensor": 2,
        "sequence_parallel": True,
        "trainer": {"use_distributed_optimizer": True},
    },
    # --bf16, replicated and sharded: the sharded ranks must take the replicated ranks' steps.
    "ep2_cp2_bf16": {"expert": 2, "context": 2, "trainer": {"bf16": True}},
    "ep2_cp2_zero1_bf16": {"expert": 2, "context": 2, "trainer": {"bf16": True, "use_distributed_optimizer": True}},
}


# (data x context parallel ranks, ranks holding the same experts) of the --use-distributed-optimizer layouts
EXPECTED_SHARD_RANKS = {"ep2_cp2_zero1": (4, 2), "ep2_tp2_sp_zero1": (2, 1), "ep2_cp2_zero1_bf16": (4, 2)}


def test_megatron_expert_parallel_ranks_take_one_ranks_steps(tmp_path):
    """Expert parallelism 2 in four processes (one after another in the same processes): in each of two
    pipeline stages; with tensor and sequence parallelism 2, each expert split over the two tensor-parallel
    ranks (expert tensor parallelism 2, Megatron's default) or whole on each (expert tensor parallelism 1); and
    over two context-parallel ranks; and under tensor parallelism with token budgets and --balance-data (each
    pass's micro-batches split to an even count, as many for each rank); and with --use-distributed-optimizer
    (ZeRO-1: the experts' optimizer state split over the ranks holding the same experts, the rest's over the
    data-parallel ranks), alone and under tensor parallelism. Tokens are exchanged between the ranks
    inside every MoE layer; dense
    weights are data-parallel replicas or tensor shards. The torch backend's single-rank numbers on the same
    HF MoE model, the experts gathered back for export, and each torch_dist checkpoint resumed in one
    process."""
    from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_convert import read_hf_state_dict
    from vime.backends.torch_backend import TorchBackend

    moe_dir = megatron_shim.tiny_moe_hf_model(str(tmp_path / "moe"), "qwen3_moe", with_tokenizer=True)
    ranks = _spawn_ranks("megatron_ep", moe_dir, str(tmp_path), world=4, layouts=EXPERT_LAYOUTS)
    megatron_shim.install()
    reference = TorchBackend(trainer_spec(moe_dir, **TORCH_RUNS["kl_loss_entropy"]))
    expected = [reference.train_rollout(make_samples(seed), 0) for seed in (0, 1)]
    # transformers fuses the experts in memory; its saved files name them one by one, as the export does.
    reference.save_weights(str(tmp_path / "reference"))
    expected_weights = read_hf_state_dict(str(tmp_path / "reference"))
    for layout_id, layout in EXPERT_LAYOUTS.items():
        overrides = layout.get("trainer", {})
        if overrides.get("use_distributed_optimizer"):
            sharding = [rank[layout_id]["sharding"] for rank in ranks]
            assert [(s["dense_ranks"], s["expert_ranks"]) for s in sharding] == [EXPECTED_SHARD_RANKS[layout_id]] * 4
            for s in sharding:  # each rank's share of both groups, up to one element of padding in each
                even = s["dense"] / s["dense_ranks"] + s["expert"] / s["expert_ranks"]
                assert abs(s["moments"] - even) <= 2, (layout_id, s)
        if overrides.get("bf16"):  # not the float32 reference's forward: compared with its replicated twin below
            continue
        if overrides.get("use_dynamic_batch_size"):  # other micro-batches: the steps' numbers, not their means
            from tests.unit.test_dynamic_batching import assert_same_steps

            for rank in ranks:
                for got, reference in zip(rank[layout_id]["metrics"], expected, strict=True):
                    assert_same_steps(got, reference)
                    assert got["train_micro_batches"] == 4
        else:
            _assert_ranks_took_the_steps(ranks, layout_id, expected)
        for rank in ranks:
            assert rank[layout_id]["weights"].keys() == expected_weights.keys()
            for name, tensor in expected_weights.items():
                torch.testing.assert_close(
                    rank[layout_id]["weights"][name], tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=f"{layout_id}: {name}"
                )
        resumed = MegatronBackend(trainer_spec(moe_dir, **TORCH_RUNS["kl_loss_entropy"]), megatron_spec(moe_dir))
        resumed.load_training_state(str(tmp_path / f"{layout_id}_ckpt"))
        for name, tensor in resumed.hf_named_weights():
            torch.testing.assert_close(
                tensor, expected_weights[name], rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=f"{layout_id}: {name}"
            )
    # --bf16: the sharded ranks take the replicated ranks' steps, and their checkpoint (float32 masters, experts
    # gathered from the ranks holding them) resumes in one float32 process with their weights.
    from tests.unit.test_megatron_backend import assert_same_metrics

    for rank in ranks:
        sharded, replicated = rank["ep2_cp2_zero1_bf16"], rank["ep2_cp2_bf16"]
        # They did train in bf16: the gradient norm is not the float32 reference's (2.0829 against 2.0819 here).
        assert replicated["metrics"][0]["grad_norm"] != pytest.approx(expected[0]["grad_norm"], rel=1e-4)
        for ours, theirs in zip(sharded["metrics"], replicated["metrics"], strict=True):
            assert_same_metrics(ours, theirs)
        for name, tensor in replicated["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)
    resumed = MegatronBackend(trainer_spec(moe_dir, **TORCH_RUNS["kl_loss_entropy"]), megatron_spec(moe_dir))
    resumed.load_training_state(str(tmp_path / "ep2_cp2_zero1_bf16_ckpt"))
    for name, tensor in resumed.hf_named_weights():
        torch.testing.assert_close(tensor, ranks[0]["ep2_cp2_zero1_bf16"]["weights"][name], rtol=0, atol=0, msg=name)


def _tied_qwen2_with_tokenizer(folder: str, tokenizer_source: str, num_layers: int = 2) -> str:
    return _with_tokenizer(folder, tokenizer_source, "qwen2", tie=True, num_layers=num_layers)


def _with_tokenizer(folder: str, tokenizer_source: str, family: str, **model) -> str:
    """A tiny random HF model of ``family`` with the tokenizer of ``tokenizer_source``."""
    import shutil

    megatron_shim.tiny_hf_model(folder, family, **model)
    for name in os.listdir(tokenizer_source):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer_source, name), folder)
    return folder


def test_megatron_pipeline_stages_take_one_ranks_steps(model_dir, tmp_path):
    """Pipeline parallelism 2 (one decoder layer per stage; the input embedding on the first stage and its
    tied copy, the output layer, on the last): the torch backend's single-rank numbers, with KL and entropy
    and with PPO's critic (a pipelined value model too); the stages' weights gathered for export; the
    torch_dist checkpoint resumed in one stage. Three layers split one and two. And an MoE model with recorded
    routes (R3) and the routers' auxiliary loss: the numbers of the same run in one stage."""
    from tests.unit.test_megatron_backend import assert_same_metrics, make_samples, megatron_spec, trainer_spec
    from tests.unit.test_megatron_moe_r3 import make_samples as routed_samples
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_model import Parallelism
    from vime.backends.torch_backend import TorchBackend

    tied = _tied_qwen2_with_tokenizer(str(tmp_path / "tied"), model_dir)
    tied3 = _tied_qwen2_with_tokenizer(str(tmp_path / "tied3"), model_dir, num_layers=3)
    moe_dir = megatron_shim.tiny_moe_hf_model(
        str(tmp_path / "moe"), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["qwen3_moe"]
    )
    ranks = _spawn_ranks("megatron_pp", tied, str(tmp_path))
    megatron_shim.install()
    reference = TorchBackend(trainer_spec(tied3, **TORCH_RUNS["kl_loss_entropy"]))
    expected = reference.train_rollout(make_samples(0, GROUPS), 0)
    for rank in ranks:
        assert_same_metrics(rank["uneven"]["metrics"][0], expected)
        for param_name, param in reference.model.named_parameters():
            torch.testing.assert_close(
                rank["uneven"]["weights"][param_name], param.detach(), rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=param_name
            )
    one_stage = MegatronBackend(*_routed_specs(moe_dir, Parallelism()))
    _assert_ranks_took_the_steps(
        ranks, "moe_r3", [one_stage.train_rollout(routed_samples(seed, routes=True), 0) for seed in (0, 1)]
    )
    for name, algorithm in TORCH_RUNS.items():
        reference = TorchBackend(trainer_spec(tied, **algorithm))
        _assert_ranks_took_the_steps(
            ranks, name, [reference.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
        )
        expected_weights = {n: p.detach() for n, p in reference.model.named_parameters()}
        assert "lm_head.weight" not in ranks[0][name]["weights"]  # tied: exported once, as the embedding
        for rank in ranks:
            assert rank[name]["weights"].keys() == expected_weights.keys()
            for param_name, tensor in expected_weights.items():
                torch.testing.assert_close(
                    rank[name]["weights"][param_name],
                    tensor,
                    rtol=0,
                    atol=ADAMW_WEIGHT_ATOL,
                    msg=f"{name}: {param_name}",
                )
        from vime.backends.megatron_convert import read_hf_state_dict

        written = read_hf_state_dict(str(tmp_path / f"pp_{name}_weights"))
        assert written.keys() == expected_weights.keys()
        for param_name, tensor in expected_weights.items():
            torch.testing.assert_close(written[param_name], tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=param_name)
        resumed = MegatronBackend(trainer_spec(tied, **algorithm), megatron_spec(tied))
        resumed.load_training_state(str(tmp_path / f"pp_{name}_ckpt"))
        for param_name, tensor in resumed.hf_named_weights():
            torch.testing.assert_close(
                tensor, expected_weights[param_name], rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=param_name
            )


QWEN3_LAYOUTS = {
    "tp2_sp_cp2": {"tensor": 2, "sequence_parallel": True, "context": 2},
    "cp2_pp2": {"context": 2, "pipeline": 2},
}


def test_megatron_tensor_and_context_parallel_qwen3_take_one_ranks_steps(model_dir, tmp_path):
    """Qwen3 (query and key norms, head size unlike hidden / heads) in four processes, two layouts one after the
    other: two tensor-parallel ranks with sequence parallelism (the norms are shared by heads the ranks split:
    their gradients add up), and two pipeline stages; each context-parallel over two ranks (each runs half of
    every sequence and attends to the other's keys and values). The torch backend's numbers and weights, with
    KL and entropy and with PPO's critic, and a resume in one process. And an MoE model with recorded routes
    (R3, sliced as the sequence is) and the auxiliary loss (under tensor parallelism, the experts split over its
    ranks): the numbers of one process."""
    from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec
    from tests.unit.test_megatron_moe_r3 import make_samples as routed_samples
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_model import Parallelism
    from vime.backends.torch_backend import TorchBackend

    qwen3 = _with_tokenizer(str(tmp_path / "qwen3"), model_dir, "qwen3")
    moe_dir = megatron_shim.tiny_moe_hf_model(
        str(tmp_path / "moe"), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["qwen3_moe"]
    )
    ranks = _spawn_ranks("megatron_layout", qwen3, str(tmp_path), world=4, layouts=QWEN3_LAYOUTS)
    megatron_shim.install()
    for name, algorithm in TORCH_RUNS.items():
        reference = TorchBackend(trainer_spec(qwen3, **algorithm))
        expected = [reference.train_rollout(make_samples(seed, GROUPS), 0) for seed in (0, 1)]
        # AdamW (lr 1e-3) turns the order of floating-point additions into differences of up to ~3e-5 where a
        # gradient is near zero; a wrong gradient moves a weight by about the learning rate.
        expected_weights = {n: p.detach() for n, p in reference.model.named_parameters()}
        for layout_id in QWEN3_LAYOUTS:
            key = f"{layout_id}/{name}"
            _assert_ranks_took_the_steps(ranks, key, expected)
            for rank in ranks:
                for param_name, tensor in expected_weights.items():
                    torch.testing.assert_close(
                        rank[key]["weights"][param_name], tensor, rtol=0, atol=1e-4, msg=f"{key}: {param_name}"
                    )
            resumed = MegatronBackend(trainer_spec(qwen3, **algorithm), megatron_spec(qwen3))
            resumed.load_training_state(str(tmp_path / f"{layout_id}_{name}_ckpt"))
            for param_name, tensor in resumed.hf_named_weights():
                assert torch.equal(tensor, ranks[0][key]["weights"][param_name]), f"{key}: {param_name}"
    one_process = MegatronBackend(*_routed_specs(moe_dir, Parallelism()))
    expected = [one_process.train_rollout(routed_samples(seed, routes=True), 0) for seed in (0, 1)]
    for layout_id in QWEN3_LAYOUTS:
        _assert_ranks_took_the_steps(ranks, f"{layout_id}/moe_r3", expected)


def test_context_parallel_ranks_hold_balanced_chunks_as_megatron_does():
    """Rank r of CP holds chunks r and 2CP-1-r of 2CP (megatron-core's rotary embeddings assume it), and thd
    packing, which context parallelism does not run, is refused naming the flag."""
    import types

    from vime.backends.megatron_context import ContextSplit
    from vime.backends.megatron_model import Parallelism
    from vime.backends.megatron_setup import context_split

    assert ContextSplit(None, 0, 2).positions(8).tolist() == [0, 1, 6, 7]
    assert ContextSplit(None, 1, 2).positions(8).tolist() == [2, 3, 4, 5]
    assert ContextSplit(None, 1, 2).gathered_positions(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        ContextSplit(None, 0, 2).positions(6)
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2: packed \(thd\) sequences"):
        context_split(types.SimpleNamespace(parallel=Parallelism(context=2), packing="thd"))


def test_pipeline_stages_must_split_the_layers_as_megatron_does():
    from vime.backends.megatron_model import Parallelism
    from vime.backends.megatron_pipeline import check_stage_layers

    check_stage_layers(3, Parallelism(pipeline=2, first_stage_layers=1))
    check_stage_layers(6, Parallelism(pipeline=4, first_stage_layers=2, last_stage_layers=2))
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-size 2 must divide the model's 3 layers"):
        check_stage_layers(3, Parallelism(pipeline=2))
    with pytest.raises(
        ValueError, match="^--decoder-last-pipeline-num-layers 2: the model's 2 layers .* leave 0 for the other 1"
    ):
        check_stage_layers(2, Parallelism(pipeline=2, last_stage_layers=2))
    with pytest.raises(
        ValueError, match="^--decoder-first-pipeline-num-layers 1, --decoder-last-pipeline-num-layers 1:"
    ):
        check_stage_layers(3, Parallelism(pipeline=2, first_stage_layers=1, last_stage_layers=1))


def test_expert_parallel_ranks_refuse_a_rollout_they_cannot_share_evenly():
    """A rank with no micro-batch while the others exchange tokens would hang: the step is refused first."""
    import types

    from tests.unit.test_megatron_backend import make_samples
    from vime.backends.megatron_backend import MegatronBackend

    backend = types.SimpleNamespace(
        expert_dp=object(),
        dp=types.SimpleNamespace(size=2),
        spec=types.SimpleNamespace(micro_batch_size=4, global_batch_size=8),
    )
    MegatronBackend._check_lockstep(backend, make_samples(0, groups=2))  # 2 micro-batches, one step: even
    with pytest.raises(ValueError, match="^--expert-model-parallel-size: 12 samples make 3 micro-batch"):
        MegatronBackend._check_lockstep(backend, make_samples(0, groups=3))
    # Token budgets: the layout gives each rank as many micro-batches; only a step of fewer samples than ranks
    # cannot be shared (12 samples in steps of 11 leave one sample for the second step).
    backend.spec = types.SimpleNamespace(micro_batch_size=4, global_batch_size=11, use_dynamic_batch_size=True)
    MegatronBackend._check_lockstep(backend, make_samples(0, groups=3)[:10])  # one step of 10
    with pytest.raises(ValueError, match="^--global-batch-size: 12 samples make optimizer steps of \\[11, 1\\]"):
        MegatronBackend._check_lockstep(backend, make_samples(0, groups=3))
