"""AdamW with its moments stored in bf16 (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16; vime/backends/adamw_state_dtype.py): torch's AdamW step for step with float32 moments,
bf16 moments that take half the bytes and stay close, checkpoints that keep each side's dtype, and the flags'
start-up checks. The two-rank FSDP2 side (sharded bf16 moments, a resume at another rank count) is in
test_fsdp_backend.py."""

import copy

import pytest
import torch

from tests.train_args import minimal_train_argv as base
from vime.backends.adamw_state_dtype import AdamWWithStateDtype
from vime.config import ConfigError, parse_train_args

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        module(torch.randn(8, 16, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_float32_moments_take_torch_adamw_s_steps_exactly():
    ours, torchs = model(), model()
    train(ours, AdamWWithStateDtype(ours.parameters(), **SETTINGS), 20)
    train(torchs, torch.optim.AdamW(torchs.parameters(), **SETTINGS), 20)
    assert max_difference(ours, torchs) == 0.0


def test_bf16_moments_take_half_the_bytes_and_stay_close_to_float32_ones():
    bf16, reference = model(), model()
    optimizer = AdamWWithStateDtype(
        bf16.parameters(), **SETTINGS, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    )
    adamw = torch.optim.AdamW(reference.parameters(), **SETTINGS)
    train(bf16, optimizer, 20)
    train(reference, adamw, 20)
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert {v.dtype for v in moments} == {torch.bfloat16}
    assert {p.dtype for p in bf16.parameters()} == {torch.float32}  # the parameters keep theirs
    ours_bytes = sum(v.numel() * v.element_size() for v in moments)
    float32_bytes = sum(v.numel() * v.element_size() for s in adamw.state.values() for k, v in s.items() if k != "step")
    assert ours_bytes * 2 == float32_bytes
    # 20 steps of lr 1e-2 move each weight by up to ~0.2; rounding the moments changes that by well under 1%.
    difference = max_difference(bf16, reference)
    assert 0 < difference < 2e-3, difference


def test_a_checkpoint_keeps_each_optimizer_s_moment_dtypes():
    source, target = model(), model()
    adamw = torch.optim.AdamW(source.parameters(), **SETTINGS)
    train(source, adamw, 3)
    bf16 = AdamWWithStateDtype(
        target.parameters(), **SETTINGS, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float32
    )
    bf16.load_state_dict(copy.deepcopy(adamw.state_dict()))  # float32 moments into bf16 ones: rounded
    for param, theirs in zip(target.parameters(), source.parameters()):
        state, expected = bf16.state[param], adamw.state[theirs]
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(state["exp_avg"], expected["exp_avg"].to(torch.bfloat16))
        assert float(state["step"]) == 3.0
    back = torch.optim.AdamW(model().parameters(), **SETTINGS)
    back.load_state_dict(bf16.state_dict())  # and the reverse: widened by torch's own load
    assert {v.dtype for s in back.state.values() for k, v in s.items() if k != "step"} == {torch.float32}


def test_the_flags_reach_the_torch_backend_s_optimizer(tmp_path):
    from vime.backends.torch_backend import make_optimizer
    from workers.trainer_worker import TrainerWorkerSpec

    (tmp_path / "config.json").write_text("{}")
    flags = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    s = parse_train_args(base(str(tmp_path), *flags))
    spec = TrainerWorkerSpec.from_settings(s, transport="disk", store=None, threads=1, cpu_affinity=None).backend
    optimizer = make_optimizer(model().parameters(), spec, {})
    assert isinstance(optimizer, AdamWWithStateDtype)
    assert optimizer.moment_dtypes == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    plain = TrainerWorkerSpec.from_settings(
        parse_train_args(base(str(tmp_path), "--use-precision-aware-optimizer")),
        transport="disk",
        store=None,
        threads=1,
        cpu_affinity=None,
    ).backend
    assert type(make_optimizer(model().parameters(), plain, {})) is torch.optim.AdamW


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--exp-avg-dtype", "bf16"], "^--exp-avg-dtype: bf16 needs --use-precision-aware-optimizer"),
        (["--main-grads-dtype", "bf16"], "^--main-grads-dtype: bf16 needs --use-precision-aware-optimizer"),
        (
            ["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp16"],
            "^--exp-avg-sq-dtype: fp16 is not implemented in vime: .*per-tensor scaling",
        ),
        (
            ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"],
            "^--main-params-dtype: fp16 is not implemented in vime: master weights are fp32",
        ),
        (
            ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--optimizer", "sgd"],
            "^--exp-avg-dtype: bf16 is AdamW's state; --optimizer is sgd",
        ),
    ],
)
def test_bad_combinations_are_refused_naming_the_flag(tmp_path, flags, message):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=message):
        parse_train_args(base(str(tmp_path), *flags))


def test_the_megatron_backend_takes_bf16_moments_too(tmp_path):
    """Its trainer steps vime's AdamW as well (tests/unit/test_megatron_distributed_optimizer.py trains and resumes
    it); --ray-address: the Megatron backend needs CUDA where its trainer runs, which is then not this machine."""
    (tmp_path / "config.json").write_text("{}")
    flags = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    settings = parse_train_args(base(str(tmp_path), *flags, "--train-backend", "megatron", "--ray-address", "auto"))
    assert (settings.perf.exp_avg_dtype, settings.perf.exp_avg_sq_dtype) == ("bf16", "bf16")


def test_the_update_by_slices_equals_the_whole_tensor_s(monkeypatch):
    from vime.backends import adamw_state_dtype

    dtypes = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
    whole, sliced = model(), model()
    train(whole, AdamWWithStateDtype(whole.parameters(), **SETTINGS, **dtypes), 5)
    monkeypatch.setattr(adamw_state_dtype, "CHUNK_ELEMENTS", 7)  # slices that divide no tensor evenly
    train(sliced, AdamWWithStateDtype(sliced.parameters(), **SETTINGS, **dtypes), 5)
    assert max_difference(whole, sliced) == 0.0
