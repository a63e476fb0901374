"""The Megatron-style learning-rate schedule: its formulas against hand-computed values, the flags'
start-up checks, both backends stepping it, and checkpoints that continue it exactly."""

import math

import pytest
import torch
from test_rl_torch_backend import GROUP, make_samples

from tests.train_args import minimal_train_argv as args
from vime.backends.lr_schedule import (
    DECAY_STYLES,
    WSD_DECAY_STYLES,
    LRSchedule,
    lr_schedule_from_settings,
    optimizer_steps_per_rollout,
)
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config import ConfigError, parse_train_args
from vime.config.algorithm import AlgorithmConfig
from vime.config.roles import CHOICE_KEYS, parse_role_config
from vime.config.training import TrainConfig

# ----------------------------------------------------------------------------- the formulas
# lr 1, min-lr 0.1, 2 warmup steps from 0, decay over 10 steps (8 after the warmup).
SHAPE = dict(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=10)


def test_warmup_is_linear_from_the_init_and_ends_at_the_peak():
    for style in ("constant", "linear", "cosine"):
        schedule = LRSchedule(**SHAPE, decay_style=style)
        assert [schedule.lr_at(i) for i in range(3)] == [0.0, 0.5, 1.0], style
    started = LRSchedule(**SHAPE, warmup_init=0.2, decay_style="linear")
    assert started.lr_at(0) == 0.2 and started.lr_at(1) == pytest.approx(0.6)
    fractional = LRSchedule(lr=1.0, warmup_iters=0.25 * 10, decay_iters=10, decay_style="linear")
    assert fractional.lr_at(1) == pytest.approx(0.4) and fractional.lr_at(2) == pytest.approx(0.8)


def test_constant_keeps_the_peak_after_the_warmup_and_past_the_decay():
    schedule = LRSchedule(**SHAPE, decay_style="constant")
    assert [schedule.lr_at(i) for i in (2, 6, 10, 11, 1000)] == [1.0] * 5
    assert LRSchedule(lr=3e-6).lr_at(0) == 3e-6 and LRSchedule(lr=3e-6).lr_at(10**6) == 3e-6


def test_linear_decay():
    schedule = LRSchedule(**SHAPE, decay_style="linear")
    assert schedule.lr_at(6) == pytest.approx(0.55)  # midpoint of the decay: (0.1 + 1) / 2
    assert schedule.lr_at(3) == pytest.approx(0.8875)  # 1 - 0.9 / 8
    assert schedule.lr_at(10) == pytest.approx(0.1)  # end of the decay: the floor
    assert schedule.lr_at(11) == 0.1 and schedule.lr_at(500) == 0.1


def test_cosine_decay():
    schedule = LRSchedule(**SHAPE, decay_style="cosine")
    assert schedule.lr_at(6) == pytest.approx(0.55)
    assert schedule.lr_at(4) == pytest.approx(0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2)  # a quarter in: cos(pi/4)
    assert schedule.lr_at(10) == pytest.approx(0.1)
    assert schedule.lr_at(11) == 0.1


def test_inverse_square_root_decay():
    schedule = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=100, decay_style="inverse-square-root")
    assert schedule.lr_at(2) == 0.5 and schedule.lr_at(4) == 1.0
    assert schedule.lr_at(16) == pytest.approx(0.5) and schedule.lr_at(64) == pytest.approx(0.25)
    floored = LRSchedule(lr=1.0, min_lr=0.3, warmup_iters=4, decay_iters=100, decay_style="inverse-square-root")
    assert floored.lr_at(64) == 0.3
    assert schedule.lr_at(101) == 0.1  # past --lr-decay-iters


def test_wsd_is_stable_then_anneals_over_its_last_steps():
    linear = LRSchedule(
        lr=1.0, min_lr=0.1, decay_iters=10, decay_style="WSD", wsd_decay_iters=4, wsd_decay_style="linear"
    )
    assert [linear.lr_at(i) for i in (0, 3, 6)] == [1.0, 1.0, 1.0]
    assert linear.lr_at(8) == pytest.approx(0.55) and linear.lr_at(10) == pytest.approx(0.1)
    assert linear.lr_at(11) == 0.1
    expected = {"exponential": 2 * 0.5**0.5 - 1, "cosine": 0.5, "minus_sqrt": 1 - 0.5**0.5, "linear": 0.5}
    for style, coeff in expected.items():
        schedule = LRSchedule(
            lr=1.0, min_lr=0.1, decay_iters=10, decay_style="WSD", wsd_decay_iters=4, wsd_decay_style=style
        )
        assert schedule.lr_at(8) == pytest.approx(0.1 + 0.9 * coeff), style


def test_role_schedule_scales_to_its_lr_unless_overridden():
    base = LRSchedule(lr=1e-6, min_lr=1e-7, warmup_init=1e-8, warmup_iters=2, decay_iters=10, decay_style="cosine")
    critic = parse_role_config({"megatron": [{"role": "critic", "overrides": {"lr": "1e-5"}}]}).role("critic")
    scaled = base.for_role(critic)
    assert (scaled.lr, scaled.min_lr, scaled.warmup_init) == pytest.approx((1e-5, 1e-6, 1e-7))
    assert scaled.lr_at(10) == pytest.approx(1e-6) and scaled.decay_style == "cosine"
    overrides = {"lr": "1e-5", "min_lr": 0, "lr_warmup_iters": 0, "lr_decay_style": "linear"}
    own = base.for_role(parse_role_config({"megatron": [{"role": "critic", "overrides": overrides}]}).role("critic"))
    assert own.lr_at(0) == 1e-5 and own.lr_at(5) == pytest.approx(5e-6) and own.lr_at(10) == 0.0
    assert base.for_role(parse_role_config(None).role("actor")) == base  # no entry: the command line's


def test_role_schedule_errors_name_the_yaml_field():
    base = LRSchedule(lr=1e-6, warmup_iters=2, decay_iters=10, decay_style="linear")
    late = parse_role_config({"megatron": [{"role": "critic", "overrides": {"lr_warmup_iters": 10}}]}, "r.yaml")
    field = r"^--megatron-config-path: r.yaml: megatron\[0\].overrides"
    with pytest.raises(ConfigError, match=field + r".lr_warmup_iters: the warmup"):
        base.for_role(late.role("critic"), late.source)
    high = parse_role_config({"megatron": [{"role": "critic", "overrides": {"min_lr": 1e-5}}]}, "r.yaml")
    with pytest.raises(ConfigError, match=r"megatron\[0\].overrides.min_lr: min_lr 1e-05 is above"):
        base.for_role(high.role("critic"), high.source)
    wsd = parse_role_config({"megatron": [{"role": "actor", "overrides": {"lr_decay_style": "WSD"}}]}, "r.yaml")
    with pytest.raises(ConfigError, match=r"lr_decay_style: WSD needs --lr-wsd-decay-iters"):
        base.for_role(wsd.role("actor"), wsd.source)
    for overrides, key in (
        ({"lr_decay_style": "step"}, "lr_decay_style"),
        ({"lr_warmup_iters": 1.5}, "lr_warmup_iters"),
        ({"lr_warmup_iters": -1}, "lr_warmup_iters"),
        ({"lr": 1e-6, "min_lr": 1e-5}, "min_lr"),
    ):
        with pytest.raises(ConfigError, match=rf"megatron\[0\].overrides.{key}: "):
            parse_role_config({"megatron": [{"role": "critic", "overrides": overrides}]})


def test_the_style_lists_agree():
    flags = {f.name: f.metadata.get("choices") for f in TrainConfig.__dataclass_fields__.values()}
    assert tuple(flags["lr_decay_style"]) == DECAY_STYLES == CHOICE_KEYS["lr_decay_style"]
    assert tuple(flags["lr_wsd_decay_style"]) == WSD_DECAY_STYLES


def test_optimizer_steps_per_rollout_follow_the_backends():
    assert optimizer_steps_per_rollout(64, 64, 8) == 1
    assert optimizer_steps_per_rollout(64, 16, 8) == 4
    assert optimizer_steps_per_rollout(64, 4, 8) == 8  # a global batch below one micro-batch: one per micro-batch


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction"),
        (["--lr-warmup-fraction", "1.0"], "--lr-warmup-fraction"),
        (["--lr", "1e-6", "--min-lr", "2e-6"], "--min-lr"),
        (["--min-lr=-1e-7"], "--min-lr"),
        (["--lr", "1e-6", "--lr-warmup-init", "2e-6"], "--lr-warmup-init"),
        (["--lr-warmup-iters=-1"], "--lr-warmup-iters"),
        (["--lr-warmup-iters", "10", "--lr-decay-iters", "5"], "--lr-decay-iters"),
        (["--lr-warmup-iters", "5", "--lr-decay-iters", "5"], "--lr-decay-iters"),
        (["--lr-decay-iters", "0"], "--lr-decay-iters"),
        (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
        (["--lr-decay-style", "WSD", "--lr-decay-iters", "10", "--lr-wsd-decay-iters", "11"], "--lr-wsd-decay-iters"),
        (["--lr-wsd-decay-iters", "3"], "--lr-wsd-decay-iters"),
    ],
)
def test_flag_errors_name_the_flag(config_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(args(config_dir, *extra))
    assert str(error.value).startswith(flag + ":"), str(error.value)


def test_schedule_from_the_command_line(config_dir):
    # 4 prompts x 8 samples, 16 per optimizer step: 2 steps per rollout, 10 rollouts.
    run = [
        "--num-rollout",
        "10",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "8",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "8",
        "--lr",
        "2e-6",
    ]
    default = lr_schedule_from_settings(parse_train_args(args(config_dir, *run)))
    assert default == LRSchedule(lr=2e-6, decay_iters=20)  # constant, as before
    schedule = lr_schedule_from_settings(
        parse_train_args(
            args(config_dir, *run, "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1", "--min-lr", "1e-7")
        )
    )
    assert (schedule.decay_iters, schedule.warmup_iters, schedule.min_lr) == (20, 2.0, 1e-7)
    # The default --lr-decay-iters is the run's step count: a warmup as long is refused, naming the flag.
    with pytest.raises(ConfigError, match=r"^--lr-warmup-iters: 20 warmup steps .*\(--num-rollout 10 x 2 "):
        lr_schedule_from_settings(parse_train_args(args(config_dir, *run, "--lr-warmup-iters", "20")))
    with pytest.raises(ConfigError, match=r"^--lr-wsd-decay-iters: 30 is more than the 20 decay steps"):
        lr_schedule_from_settings(
            parse_train_args(args(config_dir, *run, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30"))
        )


def test_role_overrides_are_checked_with_the_command_line(config_dir, tmp_path):
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - role: critic\n    overrides:\n      lr_warmup_iters: 3\n")
    run = [
        "--advantage-estimator",
        "ppo",
        "--megatron-config-path",
        str(roles),
        "--num-rollout",
        "3",
        "--lr-decay-style",
        "linear",
    ]
    with pytest.raises(ConfigError, match=r"^--megatron-config-path: .*overrides.lr_warmup_iters: the warmup"):
        lr_schedule_from_settings(parse_train_args(args(config_dir, *run)))
    roles.write_text("megatron:\n  - role: critic\n    overrides:\n      lr_warmup_iters: 2\n")
    assert lr_schedule_from_settings(parse_train_args(args(config_dir, *run))).decay_iters == 3


# ----------------------------------------------------------------------------- the torch backend
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("lr_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# Peak 1e-3, 2 warmup steps from 0, linear to 1e-4 at step 4; 8 samples and 4 per step: 2 steps per rollout.
SCHEDULE = LRSchedule(lr=1e-3, min_lr=1e-4, warmup_iters=2, decay_iters=4, decay_style="linear")


def spec(model_dir, schedule=SCHEDULE, **algorithm) -> TorchTrainerSpec:
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=1e-3,
        weight_decay=0.0,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=4,
        global_batch_size=GROUP,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        algorithm=algo,
        seed=0,
        threads=1,
        lr_schedule=schedule,
    )


def record_step_lrs(role) -> list[float]:
    """The learning rate of each optimizer step the role takes from now on."""
    seen, step = [], role.optimizer.step

    def recording(*a, **k):
        seen.append([group["lr"] for group in role.optimizer.param_groups])
        return step(*a, **k)

    role.optimizer.step = recording
    return seen


def test_torch_backend_sets_the_rate_of_every_step_across_rollouts(model_dir, model):
    trainer = TorchBackend(spec(model_dir))
    seen = record_step_lrs(trainer.actor)
    first = trainer.train_rollout(make_samples(model), policy_version=0)
    second = trainer.train_rollout(make_samples(model, seed=1), policy_version=0)
    assert first["optimizer_steps"] == second["optimizer_steps"] == 2
    assert seen == [[0.0], [5e-4], [1e-3], [pytest.approx(5.5e-4)]]
    assert first["lr"] == pytest.approx(2.5e-4) and second["lr"] == pytest.approx(7.75e-4)  # the steps' mean
    assert trainer.actor.optimizer_steps == 4
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # the next step's
    third = trainer.train_rollout(make_samples(model, seed=2), policy_version=0)
    assert third["lr"] == pytest.approx(1e-4)  # the floor


def test_without_a_schedule_the_rate_stays_the_command_lines(model_dir, model):
    trainer = TorchBackend(spec(model_dir, schedule=None))
    assert trainer.train_rollout(make_samples(model), policy_version=0)["lr"] == 1e-3


def test_checkpoint_continues_the_schedule_exactly(model_dir, model, tmp_path):
    trainer = TorchBackend(spec(model_dir))
    trainer.train_rollout(make_samples(model), policy_version=0)
    trainer.save_training_state(str(tmp_path / "ckpt"))
    after = trainer.train_rollout(make_samples(model, seed=1), policy_version=0)

    resumed = TorchBackend(spec(model_dir))
    assert resumed.optimizer.param_groups[0]["lr"] == 0.0
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert resumed.actor.optimizer_steps == 2 and resumed.optimizer.param_groups[0]["lr"] == 1e-3
    seen = record_step_lrs(resumed.actor)
    again = resumed.train_rollout(make_samples(model, seed=1), policy_version=0)
    assert seen == [[1e-3], [pytest.approx(5.5e-4)]]
    assert {k: v for k, v in again.items() if k != "train_seconds"} == {
        k: v for k, v in after.items() if k != "train_seconds"
    }
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)

    # A checkpoint written before the count was saved: AdamW's own step count stands in for it.
    state = torch.load(tmp_path / "ckpt" / "optimizer_and_rng.pt", weights_only=False)
    del state["optimizer_steps"]
    torch.save(state, tmp_path / "ckpt" / "optimizer_and_rng.pt")
    old = TorchBackend(spec(model_dir))
    old.load_training_state(str(tmp_path / "ckpt"))
    assert old.actor.optimizer_steps == 2


def test_no_load_optim_takes_the_weights_and_starts_the_optimizer_and_schedule_afresh(model_dir, model, tmp_path):
    """--no-load-optim (Megatron-LM's): the checkpoint's weights and position in the run, a fresh AdamW and the
    schedule from its start (warm-up included), as Megatron-LM's scheduler without its saved state."""
    trainer = TorchBackend(spec(model_dir))
    trainer.train_rollout(make_samples(model), policy_version=0)
    trainer.save_training_state(str(tmp_path / "ckpt"))
    fresh = TorchBackend(spec(model_dir))
    fresh.load_training_state(str(tmp_path / "ckpt"), optimizer=False)
    assert not fresh.optimizer.state  # no moments until its first step
    assert fresh.actor.optimizer_steps == 0 and fresh.optimizer.param_groups[0]["lr"] == 0.0
    assert fresh.rollouts_trained == trainer.rollouts_trained == 1
    for a, b in zip(trainer.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    first = fresh.train_rollout(make_samples(model, seed=1), policy_version=0)
    assert first["lr"] == pytest.approx(2.5e-4)  # the first rollout's rates again (a full load: 7.75e-4)
    assert fresh.optimizer.state  # and AdamW has moments now


def test_ppo_critic_has_its_own_scaled_schedule_and_step_count(model_dir, model, tmp_path):
    roles = tmp_path / "roles.yaml"
    roles.write_text("megatron:\n  - role: critic\n    overrides:\n      lr: 1e-2\n")
    trainer = TorchBackend(
        spec(model_dir, advantage_estimator="ppo", num_critic_only_steps=1, megatron_config_path=str(roles))
    )
    assert trainer.critic.schedule.min_lr == pytest.approx(1e-3)  # 1e-4 x (1e-2 / 1e-3)
    critic_only = trainer.train_rollout(make_samples(model), policy_version=0)
    assert "lr" not in critic_only and critic_only["critic_lr"] == pytest.approx(2.5e-3)
    assert (trainer.actor.optimizer_steps, trainer.critic.optimizer_steps) == (0, 2)
    trainer.save_training_state(str(tmp_path / "ckpt"))
    resumed = TorchBackend(
        spec(model_dir, advantage_estimator="ppo", num_critic_only_steps=1, megatron_config_path=str(roles))
    )
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert (resumed.actor.optimizer_steps, resumed.critic.optimizer_steps) == (0, 2)
    both = resumed.train_rollout(make_samples(model, seed=1), policy_version=0)
    assert both["lr"] == pytest.approx(2.5e-4) and both["critic_lr"] == pytest.approx(7.75e-3)


# ----------------------------------------------------------------------------- the Megatron backend
def test_megatron_backend_steps_and_checkpoints_the_schedule(tmp_path):
    pytest.importorskip("megatron.core")
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests import megatron_shim
    from vime.backends.megatron_args import model_args_from_hf
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.megatron_spec import MegatronBackendSpec

    megatron_shim.install()
    model_dir = megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path / "tiny"))

    def build():
        megatron = MegatronBackendSpec(
            model=model_args_from_hf(AutoConfig.from_pretrained(model_dir)), ckpt_format="torch"
        )
        return MegatronBackend(spec(model_dir), megatron)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build()
        first = trainer.train_rollout(make_samples(hf), policy_version=0)
        assert first["lr"] == pytest.approx(2.5e-4) and trainer.actor.optimizer_steps == 2
        trainer.save_training_state(str(tmp_path / "ckpt"))
        after = trainer.train_rollout(make_samples(hf, seed=1), policy_version=0)
        resumed = build()
        resumed.load_training_state(str(tmp_path / "ckpt"))
        assert resumed.actor.optimizer_steps == 2
        fresh = build()  # --no-load-optim: the weights, not the optimizer nor the schedule's position
        fresh.load_training_state(str(tmp_path / "ckpt"), optimizer=False)
        assert fresh.actor.optimizer_steps == 0 and fresh.rollouts_trained == 1
        for a, b in zip(resumed.gpt.parameters(), fresh.gpt.parameters()):
            assert torch.equal(a, b)
        again = resumed.train_rollout(make_samples(hf, seed=1), policy_version=0)
        afresh = fresh.train_rollout(make_samples(hf, seed=1), policy_version=0)
    assert again["lr"] == after["lr"] == pytest.approx(7.75e-4)
    assert afresh["lr"] == first["lr"] == pytest.approx(2.5e-4)
