"""--bf16 on the Megatron backend (TP=1 in this process, TP=2 over gloo in two spawned ones; CPU through
tests/megatron_shim.py): a bf16 GPTModel, float32 masters and AdamW state (vime/backends/precision.py), float32
checkpoints and weights published from the masters. The float32 Megatron run on the same samples is the
reference."""

import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from tests import megatron_shim  # noqa: E402
from tests.gloo_ranks import join_group, leave_group, run_ranks  # noqa: E402
from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.runtime.ports import free_port  # noqa: E402

KL = {"use_kl_loss": True, "kl_loss_coef": 0.1}


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("megatron_bf16")))


def bf16_spec(model_dir, *, bf16=True, **algorithm):
    spec = trainer_spec(model_dir, **algorithm)
    spec.bf16 = bf16
    return spec


def test_the_model_is_bf16_and_adamw_steps_float32_masters(model_dir):
    backend = MegatronBackend(bf16_spec(model_dir, **KL), megatron_spec(model_dir))
    metrics = backend.train_rollout(make_samples(0), 0)
    assert {p.dtype for p in backend.gpt.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in backend.ref_gpt.parameters()} == {torch.bfloat16}
    masters = list(backend.actor.parameters())
    assert masters and {m.dtype for m in masters} == {torch.float32}
    assert {id(p) for group in backend.optimizer.param_groups for p in group["params"]} == {id(m) for m in masters}
    for state in backend.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    assert all(p.grad is None for p in backend.gpt.parameters())
    for p, m in zip(backend.gpt.parameters(), masters):
        assert torch.equal(p, m.to(torch.bfloat16))
    # megatron-core's parameter attributes describe the masters too (the reductions and the norm read them).
    for p, m in zip(backend.gpt.parameters(), masters):
        assert getattr(m, "tensor_model_parallel", None) == getattr(p, "tensor_model_parallel", None)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl_loss"])


def test_first_losses_match_the_float32_run(model_dir):
    """SFT (token-mean NLL ~ log(12)), four steps; the tolerance is the torch backend's bf16 test's (its reasoning
    holds here: bf16 rounds relatively by 2^-9, the masters keep the runs within bf16 rounding of each other)."""
    losses = {}
    for bf16 in (False, True):
        backend = MegatronBackend(
            bf16_spec(model_dir, bf16=bf16, loss_type="sft_loss", calculate_per_token_loss=True),
            megatron_spec(model_dir),
        )
        losses[bf16] = [backend.train_rollout(make_samples(0), 0)["loss"] for _ in range(4)]
    assert losses[False][0] - losses[False][-1] > 0.05  # the reference learns: the tolerance is meaningful
    for step, (full, half) in enumerate(zip(losses[False], losses[True])):
        assert abs(full - half) < 1e-2, (step, losses)


def test_weights_leave_from_the_masters_and_a_resume_is_exact(model_dir, tmp_path):
    first = MegatronBackend(bf16_spec(model_dir), megatron_spec(model_dir, ckpt_format="torch_dist"))
    first.train_rollout(make_samples(0), 0)
    masters = [m.detach().clone() for m in first.actor.parameters()]
    exported = first.hf_named_weights()  # no --vllm-dtype: the checkpoint's float32
    assert {t.dtype for _, t in exported} == {torch.float32}
    # Some exported tensor is not representable in bf16: it came from the masters, not the bf16 model.
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for _, t in exported)
    first.export_dtype = torch.bfloat16
    assert {t.dtype for _, t in first.hf_named_weights()} == {torch.bfloat16}
    first.export_dtype = torch.float32
    first.save_training_state(str(tmp_path / "ckpt"))
    # The model holds its bf16 parameters again, and the masters are untouched by the save.
    assert {p.dtype for p in first.gpt.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(masters, first.actor.parameters()))

    after = first.train_rollout(make_samples(1), 1)
    resumed = MegatronBackend(bf16_spec(model_dir), megatron_spec(model_dir, ckpt_format="torch_dist"))
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(masters, resumed.actor.parameters()))
    again = resumed.train_rollout(make_samples(1), 1)
    assert {k: v for k, v in again.items() if k != "train_seconds"} == {
        k: v for k, v in after.items() if k != "train_seconds"
    }
    for (name, a), (_, b) in zip(first.hf_named_weights(), resumed.hf_named_weights()):
        assert torch.equal(a, b), name


def _tp2_worker(rank: int, port: int, model_dir: str, work: str) -> None:
    join_group(rank, port, megatron_shim=True)
    from vime.backends.megatron_model import Parallelism

    parallel = Parallelism(tensor=2, sequence_parallel=True)
    backend = MegatronBackend(bf16_spec(model_dir, **KL), megatron_spec(model_dir, parallel=parallel))
    metrics = [backend.train_rollout(make_samples(r), 0) for r in range(2)]
    weights = {n: t.clone() for n, t in backend.hf_named_weights()}  # gathered from the masters' shards
    # Each rank's masters of the norms, which both ranks hold whole (replicated, not split).
    norms = {
        name: master.detach().clone()
        for (name, p), master in zip(backend.gpt.named_parameters(), backend.actor.parameters())
        if "norm" in name and not getattr(p, "tensor_model_parallel", False)
    }
    torch.save({"metrics": metrics, "weights": weights, "norms": norms}, os.path.join(work, f"tp2_{rank}.pt"))
    leave_group()


def test_tensor_parallel_2_trains_as_one_rank_does(model_dir, tmp_path):
    """TP=2 with sequence parallelism in bf16 against TP=1 in bf16: the same steps within bf16 rounding (the
    ranks' partial sums round differently), the full float32 masters gathered for export, and the replicated
    norms' masters identical on both ranks."""
    one = MegatronBackend(bf16_spec(model_dir, **KL), megatron_spec(model_dir))
    reference = [one.train_rollout(make_samples(r), 0) for r in range(2)]
    run_ranks(_tp2_worker, (free_port(), model_dir, str(tmp_path)), 2)
    tp2, other = (torch.load(tmp_path / f"tp2_{rank}.pt", weights_only=False) for rank in range(2))
    # Sequence parallelism feeds each rank's norms half the tokens: their masters' gradients are summed over the
    # two ranks, so the replicated norms take the same steps on both (a master that missed the sum would not).
    assert tp2["norms"] and tp2["norms"].keys() == other["norms"].keys()
    for name, master in tp2["norms"].items():
        assert torch.equal(master, other["norms"][name]), name
    for ours, theirs in zip(tp2["metrics"], reference):
        for name in ("loss", "grad_norm", "kl_loss"):
            assert ours[name] == pytest.approx(theirs[name], rel=2e-2, abs=2e-3), (name, ours, theirs)
    exported = dict(one.hf_named_weights())
    assert tp2["weights"].keys() == exported.keys()
    assert all(t.dtype == torch.float32 for t in tp2["weights"].values())
    # lr 1e-3, two AdamW steps: AdamW moves a weight by ~lr whatever its gradient's size, so an element whose
    # gradient is near zero can step either way on bf16 rounding (measured: ~1% of the elements, by up to
    # 2 x lr). Over the whole model the rest agree far within a step: a tenth of one on average and on 95% of
    # the elements (a small tensor, a bias of 16, can have a few flips weigh on its own mean).
    gap = torch.cat([(tp2["weights"][name] - tensor).abs().flatten() for name, tensor in exported.items()])
    assert float(gap.mean()) < 1e-4 and float((gap > 1e-4).float().mean()) < 0.05, float(gap.max())


def test_the_command_line_takes_bf16_for_megatron_and_its_distributed_optimizer(model_dir, tmp_path):
    from tests.train_args import minimal_train_argv
    from vime.config import parse_train_args
    from vime.queue.rollout_queue import StoreOptions
    from vime.workers.trainer_worker import TrainerWorkerSpec

    # On a Ray cluster's trainer node (--ray-address): this machine's lack of CUDA is not checked here.
    megatron = ["--train-backend", "megatron", "--ray-address", "10.0.0.1:6379"]
    s = parse_train_args(minimal_train_argv(model_dir, *megatron, "--bf16"))
    spec = TrainerWorkerSpec.from_settings(
        s, transport="object-store", store=StoreOptions(str(tmp_path / "queue")), threads=1, cpu_affinity=None
    )
    assert spec.backend.bf16 and spec.megatron is not None and not spec.backend.use_distributed_optimizer
    # The sharded optimizer (tests/unit/test_megatron_distributed_optimizer.py) is no longer refused.
    s = parse_train_args(minimal_train_argv(model_dir, *megatron, "--bf16", "--use-distributed-optimizer"))
    assert s.train.use_distributed_optimizer and s.train.bf16
