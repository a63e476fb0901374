"""PPO with a critic: the clipped value loss and GAE against float64 references, the critic trained on the
torch backend's worker beside the actor, --num-critic-only-steps, role overrides and checkpoints."""

import math
import os

import pytest
import torch
from test_rl_torch_backend import backend, make_samples

from tests.train_args import minimal_train_argv as args
from vime.config import ConfigError, parse_train_args
from vime.config.roles import check_supported_roles, load_role_config, parse_role_config
from vime.rl.advantages import ppo_advantages_and_returns
from vime.rl.losses import clipped_value_loss, reduce_loss

F64 = torch.float64


# ----------------------------------------------------------------------------- pure functions
def ref_value_loss(values, old, returns, clip):
    """Per element, from the definition: max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
    out, clipped = [], []
    for v, o, r in zip(values, old, returns):
        moved = min(max(v - o, -clip), clip)
        out.append(max((v - r) ** 2, (o + moved - r) ** 2))
        clipped.append(1.0 if abs(v - o) > clip else 0.0)
    return out, clipped


def test_clipped_value_loss_matches_the_definition():
    # In range; moved too far up and the clipped error is larger; moved too far but the plain error is
    # larger; moved too far down; exactly at the bound (not clipped).
    values = [0.10, 1.00, 1.00, -0.90, 0.70]
    old = [0.00, 0.00, 0.00, 0.00, 0.50]
    returns = [0.50, 2.00, -1.00, 0.30, 0.00]
    clip = 0.2
    got, got_clipped = clipped_value_loss(
        torch.tensor(values, dtype=F64), torch.tensor(old, dtype=F64), torch.tensor(returns, dtype=F64), value_clip=clip
    )
    expected, expected_clipped = ref_value_loss(values, old, returns, clip)
    assert got.dtype == F64
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert got_clipped.tolist() == expected_clipped == [0.0, 1.0, 1.0, 1.0, 0.0]
    # Hand values of the two clipped cases: (0.2 - 2)^2 = 3.24 beats (1 - 2)^2; (1 + 1)^2 = 4 beats (0.2 + 1)^2.
    assert got[1].item() == pytest.approx(3.24) and got[2].item() == pytest.approx(4.0)


def test_clipped_value_loss_gradient_stops_where_the_clipped_term_wins():
    values = torch.tensor([1.0, 1.0, 0.1], dtype=F64, requires_grad=True)
    old, returns = torch.zeros(3, dtype=F64), torch.tensor([2.0, -1.0, 0.5], dtype=F64)
    loss, _ = clipped_value_loss(values, old, returns, value_clip=0.2)
    loss.sum().backward()
    # Token 0: the clipped value (constant) decides, no gradient. Token 1: the plain error 2(V - R) = 4.
    # Token 2: inside the range, 2(V - R) = -0.8.
    assert values.grad.tolist() == pytest.approx([0.0, 4.0, -0.8])


def test_value_loss_reduction_matches_a_masked_mean():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]], dtype=F64)
    assert reduce_loss(per_token, mask, per_token_loss=False).item() == pytest.approx(((1 + 3) / 2 + 4) / 2)
    assert reduce_loss(per_token, mask, per_token_loss=True).item() == pytest.approx((1 + 3 + 4) / 3)


def test_ppo_advantages_and_returns_are_gae_on_kl_shaped_rewards():
    rewards = torch.tensor([1.0, -0.5], dtype=F64)
    values = [torch.tensor([0.3, 0.1, -0.2, 0.4], dtype=F64), torch.tensor([0.5, 0.2], dtype=F64)]
    masks = [torch.tensor([1, 1, 0, 1], dtype=F64), torch.tensor([1, 0], dtype=F64)]
    kl = [torch.tensor([0.1, -0.2, 5.0, 0.3], dtype=F64), torch.tensor([0.4, 0.6], dtype=F64)]
    gamma, lambd, beta = 0.9, 0.8, 0.5
    advantages, returns = ppo_advantages_and_returns(
        rewards, values, masks, kl=kl, kl_coef=beta, gamma=gamma, lambd=lambd
    )
    for i in range(2):
        v, m, k = values[i].tolist(), masks[i].tolist(), kl[i].tolist()
        n = len(v)
        r = [-beta * k[t] * m[t] for t in range(n)]  # KL on trained tokens only
        last = max(t for t in range(n) if m[t])  # the reward is paid on the last trained token
        r[last] += rewards[i].item()
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        gae = [sum((gamma * lambd) ** (s - t) * delta[s] for s in range(t, n)) for t in range(n)]
        assert advantages[i].tolist() == pytest.approx([a * mm for a, mm in zip(gae, m)], abs=1e-12)
        assert returns[i].tolist() == pytest.approx([a + b for a, b in zip(gae, v)], abs=1e-12)


# ----------------------------------------------------------------------------- the backend
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("ppo_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def changed(before, module):
    return any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def ppo(model_dir, **algorithm):
    return backend(model_dir, advantage_estimator="ppo", **algorithm)


def test_one_ppo_step_updates_actor_and_critic_and_the_critic_learns(model_dir, model):
    trainer = ppo(model_dir, lambd=1.0)  # gamma = lambda = 1: the returns are the rewards, fixed targets
    actor, critic = params(trainer.model), params(trainer.critic.module)
    samples = make_samples(model)
    first = trainer.train_rollout(samples, policy_version=0)
    assert changed(actor, trainer.model) and changed(critic, trainer.critic.module)
    for key in (
        "loss",
        "pg_loss",
        "grad_norm",
        "value_loss",
        "value_clipfrac",
        "critic_grad_norm",
        "value_mean",
        "return_mean",
    ):
        assert math.isfinite(first[key]), key
    assert first["critic_only"] == 0.0 and first["optimizer_steps"] == 1
    # With gamma = lambda = 1 and no KL, every token's return is its sample's reward (the metric averages
    # the trained tokens of each micro-batch of 4, then the micro-batches).
    batches = [samples[i : i + 4] for i in range(0, len(samples), 4)]
    expected = [sum(s.reward * sum(s.loss_mask) for s in b) / sum(sum(s.loss_mask) for s in b) for b in batches]
    assert first["return_mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    losses = [first["value_loss"]] + [trainer.train_rollout(samples, 0)["value_loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_value_loss_is_the_clipped_regression_on_returns(model_dir, model):
    # The first optimizer step sees the old values (nothing moved yet): its loss is the plain squared error
    # of the initial critic against the returns, which we recompute here from the critic and the rewards.
    trainer = ppo(model_dir, lambd=1.0, calculate_per_token_loss=True)
    samples = make_samples(model)
    critic = trainer.critic.module
    errors, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            values = critic(torch.tensor([s.tokens]), torch.ones(1, len(s.tokens), dtype=torch.long))[0, :-1]
            response_values = values[s.prompt_length - 1 :]
            for v, m in zip(response_values.tolist(), s.loss_mask):
                if m:
                    errors, count = errors + (v - s.reward) ** 2, count + 1
    metrics = trainer.train_rollout(samples, 0)
    assert metrics["value_loss"] == pytest.approx(errors / count, rel=1e-5)
    assert metrics["value_clipfrac"] == 0.0  # one optimizer step: the values have not moved from the old ones


def test_num_critic_only_steps_keeps_the_actor_unchanged(model_dir, model):
    trainer = ppo(model_dir, num_critic_only_steps=1)
    samples = make_samples(model)
    actor, critic = params(trainer.model), params(trainer.critic.module)
    step1 = trainer.train_rollout(samples, 0)
    assert not changed(actor, trainer.model), "the actor must not train during critic-only steps"
    assert changed(critic, trainer.critic.module)
    assert step1["critic_only"] == 1.0 and step1["optimizer_steps"] == 0 and "pg_loss" not in step1
    step2 = trainer.train_rollout(samples, 1)
    assert changed(actor, trainer.model) and step2["critic_only"] == 0.0 and "pg_loss" in step2


def test_roles_take_turns_and_the_sleeping_critic_holds_no_gradients(model_dir, model):
    trainer = ppo(model_dir)
    trainer.train_rollout(make_samples(model), 0)
    assert trainer.actor.awake and not trainer.critic.awake
    assert all(p.grad is None for p in trainer.critic.module.parameters())
    assert any(p.grad is not None for p in trainer.model.parameters())  # the actor just trained
    assert trainer.critic.device.type == "cpu"


def test_checkpoint_round_trips_the_critic(model_dir, model, tmp_path):
    samples = make_samples(model)
    trainer = ppo(model_dir, num_critic_only_steps=2)
    trainer.train_rollout(samples, 0)
    trainer.save_training_state(str(tmp_path / "ckpt"))
    assert os.path.isfile(tmp_path / "ckpt" / "critic" / "value_head.safetensors")

    resumed = ppo(model_dir, num_critic_only_steps=2)
    assert changed(params(trainer.critic.module), resumed.critic.module)  # a fresh critic differs ...
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert not changed(params(trainer.critic.module), resumed.critic.module)  # ... the loaded one does not
    saved, loaded = trainer.critic.optimizer.state_dict(), resumed.critic.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, state in saved["state"].items():
        assert all(torch.equal(state[name], loaded["state"][key][name]) for name in ("exp_avg", "exp_avg_sq"))
    assert resumed.rollouts_trained == 1
    # Both continue identically: rollout 2 is still critic-only (the count was restored), rollout 3 trains both.
    for version in (1, 2):
        a, b = trainer.train_rollout(samples, version), resumed.train_rollout(samples, version)
        assert a["critic_only"] == b["critic_only"] == float(version == 1)
        assert a["value_loss"] == b["value_loss"]
        assert a.get("loss") == b.get("loss")


def test_a_checkpoint_without_critic_cannot_resume_ppo(model_dir, model, tmp_path):
    backend(model_dir).save_training_state(str(tmp_path / "grpo"))
    with pytest.raises(ValueError, match="no critic state"):
        ppo(model_dir).load_training_state(str(tmp_path / "grpo"))


def write_yaml(tmp_path, text, name="roles.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_role_overrides_set_the_learning_rates_and_the_critic_checkpoints(model_dir, model, tmp_path):
    save = tmp_path / "critic_ckpt"
    path = write_yaml(
        tmp_path,
        f"""
megatron:
  - name: default
    role: actor
    overrides:
      lr: 1e-6
  - name: default
    role: critic
    overrides:
      lr: 1e-5
      weight_decay: 0.01
      save: {save}
""",
    )
    trainer = ppo(model_dir, megatron_config_path=path)
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-6  # YAML 1.1 reads 1e-6 as a string
    assert trainer.critic.optimizer.param_groups[0]["lr"] == 1e-5
    assert trainer.critic.optimizer.param_groups[0]["weight_decay"] == 0.01
    trainer.train_rollout(make_samples(model), 0)
    trainer.save_training_state(str(tmp_path / "run_ckpt"))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (save / "iter_0000001" / "value_head.safetensors").is_file()

    # A later run's critic starts from that folder (its latest iteration).
    reload = write_yaml(tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {save}\n", "load.yaml")
    restarted = ppo(model_dir, megatron_config_path=reload)
    assert not changed(params(trainer.critic.module), restarted.critic.module)
    assert restarted.optimizer.param_groups[0]["lr"] == 1e-3  # no actor entry: the command line's


def test_critic_load_of_an_hf_folder_starts_the_body_from_it(model_dir, tmp_path):
    from vime.tools.make_tiny_model import make_tiny_model

    other = make_tiny_model(
        str(tmp_path / "other"), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=5
    )
    path = write_yaml(tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {other}\n")
    trainer = ppo(model_dir, megatron_config_path=path)
    from transformers import AutoModelForCausalLM

    other_body = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).model.state_dict()
    own_body = trainer.model.model.state_dict()
    critic_body = trainer.critic.module.body.state_dict()
    assert all(torch.equal(critic_body[k], other_body[k]) for k in critic_body)
    assert any(not torch.equal(critic_body[k], own_body[k]) for k in critic_body)


# ----------------------------------------------------------------------------- --megatron-config-path
@pytest.mark.parametrize(
    "text, field",
    [
        ("megatron:\n  - role: judge\n", "megatron[0].role"),
        ("megatron:\n  - name: default\n", "megatron[0].role"),
        ("megatron:\n  - role: critic\n  - role: critic\n", "megatron[1].role"),
        ("megatron:\n  - role: critic\n    overrides:\n      lr: fast\n", "megatron[0].overrides.lr"),
        ("megatron:\n  - role: critic\n    overrides:\n      lr: -1e-5\n", "megatron[0].overrides.lr"),
        ("megatron:\n  - role: actor\n    overrides:\n      adam_beta2: 1.0\n", "megatron[0].overrides.adam_beta2"),
        (
            "megatron:\n  - role: critic\n    overrides:\n      tensor_model_parallel_size: 2\n",
            "megatron[0].overrides.tensor_model_parallel_size",
        ),
        (
            "megatron:\n  - role: critic\n    overrides:\n      tensor-model-parallel-size: 2\n",
            "megatron[0].overrides.tensor-model-parallel-size",
        ),
        ("megatron:\n  - role: critic\n    overrides:\n      save: 3\n", "megatron[0].overrides.save"),
        ("megatron:\n  - role: critic\n    colour: red\n", "megatron[0].colour"),
        ("megatron:\n  - role: critic\n    overrides: {lr: 1}\n    args: {lr: 2}\n", "megatron[0].args"),
        ("sglang: []\n", "sglang"),
        ("megatron: {role: critic}\n", "megatron"),
    ],
)
def test_role_file_errors_name_the_yaml_field(tmp_path, text, field):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_role_config(path)
    assert str(error.value).startswith(f"--megatron-config-path: {path}: {field}: "), str(error.value)


def test_role_file_parsing():
    config = parse_role_config(
        {
            "megatron": [
                {"name": "default", "role": "critic", "args": {"lr": "1e-5", "num_nodes": 2, "lr_decay_iters": 10}}
            ]
        }
    )
    critic = config.role("critic")
    assert critic.lr == 1e-5 and critic.entry == "megatron[0]" and critic.ignored == ("num_nodes",)
    assert critic.get("lr_decay_iters") == 10 and critic.field("lr") == "megatron[0].args.lr"
    assert config.role("actor").values == {}  # absent: keeps the command line
    with pytest.raises(ConfigError, match="megatron\\[0\\].args.lr_decay_iters: the torch backend"):
        check_supported_roles(config, "torch")
    actor_save = parse_role_config({"megatron": [{"role": "actor", "overrides": {"save": "/x"}}]})
    with pytest.raises(ConfigError, match="actor's checkpoints are the run's"):
        check_supported_roles(actor_save, "torch")
    with pytest.raises(ConfigError, match="cannot read"):
        load_role_config("/nonexistent/roles.yaml")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--advantage-estimator", "ppo", "--value-clip", "0"], "--value-clip"),
        (["--advantage-estimator", "ppo", "--num-critic-only-steps", "-1"], "--num-critic-only-steps"),
        (["--num-critic-only-steps", "2"], "--num-critic-only-steps"),  # GRPO has no critic
        (["--advantage-estimator", "ppo", "--loss-type", "sft_loss"], "--loss-type"),
    ],
)
def test_refused_ppo_flags_name_the_flag(config_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(args(config_dir, *extra))
    assert str(error.value).startswith(flag + ":"), str(error.value)


def test_role_file_checks_at_start_up(config_dir, tmp_path):
    critic_only = write_yaml(tmp_path, "megatron:\n  - role: critic\n    overrides:\n      lr: 1e-5\n")
    settings = parse_train_args(args(config_dir, "--advantage-estimator", "ppo", "--megatron-config-path", critic_only))
    assert settings.algorithm.uses_critic and settings.algorithm.role_config().role("critic").lr == 1e-5
    with pytest.raises(ConfigError, match=r"^--megatron-config-path: .*megatron\[0\].role: a critic entry needs"):
        parse_train_args(args(config_dir, "--megatron-config-path", critic_only))  # GRPO
    warmup = write_yaml(tmp_path, "megatron:\n  - role: critic\n    overrides:\n      lr_decay_iters: 5\n", "w.yaml")
    with pytest.raises(ConfigError, match=r"^--megatron-config-path: .*lr_decay_iters: the torch backend"):
        parse_train_args(args(config_dir, "--advantage-estimator", "ppo", "--megatron-config-path", warmup))
    missing = write_yaml(
        tmp_path, "megatron:\n  - role: critic\n    overrides:\n      load: /nowhere/critic\n", "m.yaml"
    )
    with pytest.raises(ConfigError, match=r"^--megatron-config-path: .*overrides.load: .*does not exist"):
        parse_train_args(args(config_dir, "--advantage-estimator", "ppo", "--megatron-config-path", missing))
