"""The reference framework's objective-level hooks and flags (issue 19, point 5), on the RL objective both
backends run (vime/rl/objective.py), with real torch losses and gradients on small ragged batches:
--loss-type custom_loss, --custom-advantage-function-path, --custom-pg-loss-reducer-function-path,
--disable-compute-advantages-and-returns, --disable-rewards-normalization, --use-unbiased-kl and
--custom-convert-samples-to-train-data-path. Bad hooks fail naming the flag and the path."""

from __future__ import annotations

import collections
import dataclasses
import sys
import textwrap

import pytest
import torch

from vime.config.algorithm import AlgorithmConfig
from vime.config.base import ConfigError
from vime.config.hooks import HooksConfig
from vime.rl.advantages import grpo_advantages
from vime.rl.batch import Forward, pack
from vime.rl.kl import approx_kl
from vime.rl.objective import RLObjective
from vime.rl.user_hooks import CustomHookError
from vime.runtime.plugins import PluginError
from vime.sample import Sample

GROUP = 2

HOOKS = '''
import torch

SEEN = {}


def reinforce_loss(args, batch, logits, sum_of_sample_mean):
    """The built-in REINFORCE loss, written as a reference-framework custom loss."""
    SEEN["keys"] = sorted(batch)
    SEEN["args"] = args
    log_probs = torch.cat(batch["cur_log_probs"])
    advantages = torch.cat(batch["advantages"])
    pg_loss = sum_of_sample_mean(-advantages * log_probs)
    return pg_loss, {"pg_loss": pg_loss.detach(), "ones": sum_of_sample_mean(torch.ones_like(log_probs))}


def nll_loss(args, batch, logits, sum_of_sample_mean):
    SEEN["keys"] = sorted(batch)
    assert logits.log_probs.shape[0] == len(batch["tokens"])  # the training forward, [B, T-1]
    return sum_of_sample_mean(-torch.cat(batch["cur_log_probs"])), {}


def default_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    def reduce(x):
        parts = x.split(response_lengths)
        return sum((p * m).sum() / m.sum().clamp(min=1) for p, m in zip(parts, loss_masks))
    return reduce


def constant_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """Dr. GRPO: every sample's sum over the same constant (here 10 tokens)."""
    def reduce(x):
        parts = x.split(response_lengths)
        return sum((p * m).sum() / 10.0 for p, m in zip(parts, loss_masks))
    return reduce


def double_advantages(args, rollout_data):
    SEEN["rollout_data"] = {k: v for k, v in rollout_data.items()}
    pairs = zip(rollout_data["rewards"], rollout_data["loss_masks"])
    rollout_data["advantages"] = [2 * r * torch.ones_like(m) for r, m in pairs]
    rollout_data["returns"] = rollout_data["advantages"]


def convert(args, samples):
    """Drops each response's last token and pays reward 10 x the sample index."""
    return {
        "tokens": [s.tokens[:-1] for s in samples],
        "response_lengths": [s.response_length - 1 for s in samples],
        "rewards": [10.0 * s.index for s in samples],
        "loss_masks": [[1] * (s.response_length - 1) for s in samples],
    }


def not_a_tuple(args, batch, logits, sum_of_sample_mean):
    return 1.0


def no_returns(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(3)]


def convert_short(args, samples):
    return {"tokens": [], "response_lengths": [], "rewards": [], "loss_masks": []}


def one_arg(args):
    return None
'''


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    (tmp_path / "my_objective_hooks.py").write_text(textwrap.dedent(HOOKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_objective_hooks", None)
    import my_objective_hooks

    yield my_objective_hooks
    sys.modules.pop("my_objective_hooks", None)


def samples(rewards=(1.0, 0.0, 0.5, 2.0)):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, reward in enumerate(rewards):
        prompt = [1, 2, 3][: 2 + i % 2]
        response = torch.randint(1, 9, (3 + i,), generator=g).tolist()
        mask = [1] * len(response)
        mask[1] = 0 if i == 1 else 1  # a tool token in one sample
        out.append(
            Sample(
                group_index=i // GROUP,
                index=i % GROUP,
                tokens=prompt + response,
                response_length=len(response),
                loss_mask=mask,
                reward=reward,
                rollout_log_probs=[-1.0] * len(response),
                status=Sample.Status.COMPLETED,
            )
        )
    return out


def objective(hooks_config=None, custom_config=None, **algorithm):
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return RLObjective(
        algo,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        hf_checkpoint="none",
        hooks=hooks_config,
        custom_config=custom_config,
    )


def forward(batch, seed=1):
    """A differentiable forward: per-target log-probs from a [B, T-1] parameter (a real leaf to take gradients)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(batch.targets.shape, generator=g).requires_grad_(True)
    log_probs = torch.nn.functional.logsigmoid(theta)
    entropy = torch.rand(batch.targets.shape, generator=g)
    return theta, Forward(log_probs, entropy)


def run_loss(obj, batch, ref=None, advantages_per_batch=None, seed=1):
    theta, out = forward(batch, seed)
    old = out.log_probs.detach() - 0.1 * batch.response_mask
    metrics = collections.defaultdict(list)
    step_terms = collections.defaultdict(float)
    totals = {"num_samples": batch.input_ids.shape[0], "num_tokens": float(batch.response_mask.sum())}
    loss, _ = obj.policy_loss(batch, out, old, ref, advantages_per_batch, totals, step_terms, metrics)
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.detach(), grad, metrics, step_terms


def advantages_of(obj, batch, data, ref=None, values=None):
    old = [torch.zeros(batch.targets.shape)]
    metrics = collections.defaultdict(list)
    return obj.advantages(data, [batch], old, [ref], [values], metrics)


@pytest.mark.parametrize("per_token", [False, True])
def test_a_custom_loss_equal_to_the_built_in_one_gives_its_loss_and_gradient(hooks, per_token):
    data = samples()
    batch = pack(data, 0)
    builtin = objective(pg_loss_type="reinforce", calculate_per_token_loss=per_token)
    custom = objective(
        loss_type="custom_loss",
        custom_loss_function_path="my_objective_hooks.reinforce_loss",
        calculate_per_token_loss=per_token,
        custom_config={"my_scale": 3},
    )
    adv_builtin, _ = advantages_of(builtin, batch, data)
    adv_custom, _ = advantages_of(custom, batch, data)
    assert torch.equal(adv_builtin[0], adv_custom[0])
    loss_b, grad_b, _, terms = run_loss(builtin, batch, advantages_per_batch=adv_builtin[0])
    loss_c, grad_c, metrics, _ = run_loss(custom, batch, advantages_per_batch=adv_custom[0])
    assert loss_c == pytest.approx(float(loss_b), rel=1e-6)
    assert torch.allclose(grad_c, grad_b, atol=1e-7) and grad_c.abs().sum() > 0
    # Its metrics are per sample (per token): the sum of sample means of ones is 1 per sample (token).
    assert metrics["ones"] == [pytest.approx(1.0)]
    assert hooks.SEEN["keys"] == [
        "advantages",
        "cur_log_probs",
        "entropy",
        "log_probs",
        "loss_masks",
        "response_lengths",
        "rollout_log_probs",
        "tokens",
        "total_lengths",
    ]
    args = hooks.SEEN["args"]
    assert args.loss_type == "custom_loss" and args.my_scale == 3 and args.rewards_normalization is True


def test_without_advantages_a_custom_loss_trains_on_what_it_needs(hooks):
    data = samples()
    batch = pack(data, 0)
    obj = objective(
        loss_type="custom_loss",
        custom_loss_function_path="my_objective_hooks.nll_loss",
        disable_compute_advantages_and_returns=True,
    )
    advantages, returns = advantages_of(obj, batch, data)
    assert advantages == [None] and returns == [None]
    loss, grad, _, _ = run_loss(obj, batch, advantages_per_batch=None)
    assert "advantages" not in hooks.SEEN["keys"]
    assert torch.isfinite(loss) and grad.abs().sum() > 0


def test_a_pg_loss_reducer_replaces_the_reduction_of_pg_loss_only(hooks):
    data = samples()
    batch = pack(data, 0)
    adv, _ = advantages_of(objective(), batch, data)
    base = run_loss(objective(), batch, advantages_per_batch=adv[0])
    same = run_loss(
        objective(custom_pg_loss_reducer_function_path="my_objective_hooks.default_reducer"),
        batch,
        advantages_per_batch=adv[0],
    )
    assert same[0] == pytest.approx(float(base[0]), rel=1e-6)
    assert torch.allclose(same[1], base[1], atol=1e-7)
    drgrpo = run_loss(
        objective(custom_pg_loss_reducer_function_path="my_objective_hooks.constant_reducer"),
        batch,
        advantages_per_batch=adv[0],
    )
    # Expected by hand: each sample's masked sum over 10, summed, over the step's 4 samples.
    _, out = forward(batch)
    old = out.log_probs.detach() - 0.1 * batch.response_mask
    ratio = torch.exp(out.log_probs - old)
    per_token = -torch.minimum(ratio * adv[0], ratio.clamp(0.8, 1.2) * adv[0])
    expected = (per_token * batch.response_mask).sum().detach() / 10.0 / 4
    assert drgrpo[0] == pytest.approx(float(expected), rel=1e-5)
    # The other metrics keep the default reduction.
    assert drgrpo[2]["pg_clipfrac"] == base[2]["pg_clipfrac"]


def test_a_custom_advantage_function_sets_advantages_and_returns(hooks):
    data = samples()
    batch = pack(data, 0)
    advantages, _ = advantages_of(
        objective(custom_advantage_function_path="my_objective_hooks.double_advantages"), batch, data
    )
    seen = hooks.SEEN["rollout_data"]
    normalized = grpo_advantages(torch.tensor([s.reward for s in data]), GROUP)
    assert seen["rewards"] == pytest.approx(normalized.tolist())  # as the estimator normalises them
    assert seen["raw_reward"] == [s.reward for s in data]
    assert seen["response_lengths"] == [s.response_length for s in data]
    assert seen["values"] is None and len(seen["kl"]) == len(data)
    rows = batch.rows(advantages[0])
    for row, reward, sample in zip(rows, normalized, data):
        assert torch.allclose(row, 2 * reward * torch.tensor(sample.loss_mask, dtype=torch.float32))


def test_disable_rewards_normalization_takes_the_rewards_as_they_are():
    data = samples()
    batch = pack(data, 0)
    advantages, _ = advantages_of(objective(disable_rewards_normalization=True), batch, data)
    for row, sample in zip(batch.rows(advantages[0]), data):
        assert torch.allclose(row, sample.reward * torch.tensor(sample.loss_mask, dtype=torch.float32))
    normalized, _ = advantages_of(objective(), batch, data)
    assert not torch.equal(normalized[0], advantages[0])


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_unbiased_kl_weights_the_kl_loss_by_the_importance_ratio(kind):
    data = samples()
    batch = pack(data, 0)
    ref = torch.randn(batch.targets.shape, generator=torch.Generator().manual_seed(5)).clamp(max=0) - 1
    adv = torch.zeros(batch.targets.shape)  # the KL term alone
    common = dict(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=kind)
    plain = run_loss(objective(**common), batch, ref=ref, advantages_per_batch=adv)
    unbiased = run_loss(objective(use_unbiased_kl=True, **common), batch, ref=ref, advantages_per_batch=adv)
    _, out = forward(batch)
    old = out.log_probs.detach() - 0.1 * batch.response_mask
    weighted = approx_kl(out.log_probs, ref, kind, torch.exp(out.log_probs - old))
    mask = batch.response_mask
    expected = ((weighted * mask).sum(1) / mask.sum(1)).sum().detach() / 4
    assert unbiased[3]["kl_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert unbiased[3]["kl_loss"] != pytest.approx(plain[3]["kl_loss"], rel=1e-3)
    assert not torch.allclose(unbiased[1], plain[1])


def test_convert_samples_to_train_data_replaces_tokens_masks_and_rewards(hooks):
    data = samples()
    obj = objective(hooks_config=HooksConfig(custom_convert_samples_to_train_data_path="my_objective_hooks.convert"))
    converted = obj.train_samples(data)
    assert [s.response_length for s in converted] == [s.response_length - 1 for s in data]
    assert [s.reward for s in converted] == [0.0, 10.0, 0.0, 10.0]
    assert [s.tokens for s in converted] == [s.tokens[:-1] for s in data]
    assert all(s.rollout_log_probs is None for s in converted)  # they no longer match the responses
    assert data[0].reward == 1.0  # the rollout's samples are left as they were
    batch = pack(converted, 0)
    advantages, _ = advantages_of(obj, batch, converted)
    # Its rewards are the advantages of grpo as they are (no group normalisation).
    for row, sample in zip(batch.rows(advantages[0]), converted):
        assert torch.allclose(row, sample.reward * torch.ones(sample.response_length))


@pytest.mark.parametrize(
    "algorithm, hooks_config, error, match",
    [
        (
            {"loss_type": "custom_loss", "custom_loss_function_path": "no_such_module_xyz.loss"},
            None,
            PluginError,
            "--custom-loss-function-path no_such_module_xyz.loss: module 'no_such_module_xyz' not found",
        ),
        (
            {"loss_type": "custom_loss", "custom_loss_function_path": "my_objective_hooks.one_arg"},
            None,
            PluginError,
            r"--custom-loss-function-path my_objective_hooks.one_arg: its parameters \(args\) do not accept",
        ),
        (
            {"custom_advantage_function_path": "my_objective_hooks.missing"},
            None,
            PluginError,
            "--custom-advantage-function-path my_objective_hooks.missing: module has no attribute 'missing'",
        ),
        (
            {"custom_pg_loss_reducer_function_path": "my_objective_hooks.one_arg"},
            None,
            PluginError,
            "--custom-pg-loss-reducer-function-path my_objective_hooks.one_arg: its parameters",
        ),
        (
            {},
            HooksConfig(custom_convert_samples_to_train_data_path="my_objective_hooks.one_arg"),
            PluginError,
            "--custom-convert-samples-to-train-data-path my_objective_hooks.one_arg: its parameters",
        ),
    ],
)
def test_hooks_that_do_not_load_or_do_not_fit_are_refused(hooks, algorithm, hooks_config, error, match):
    with pytest.raises(error, match=match):
        objective(hooks_config=hooks_config, **algorithm)


def test_hooks_returning_the_wrong_thing_name_the_flag(hooks):
    data = samples()
    batch = pack(data, 0)
    obj = objective(loss_type="custom_loss", custom_loss_function_path="my_objective_hooks.not_a_tuple")
    adv, _ = advantages_of(obj, batch, data)
    with pytest.raises(CustomHookError, match="--custom-loss-function-path .*: returned float; expected"):
        run_loss(obj, batch, advantages_per_batch=adv[0])
    obj = objective(custom_advantage_function_path="my_objective_hooks.no_returns", advantage_estimator="ppo")
    with pytest.raises(CustomHookError, match=r"rollout_data\['advantages'\] holds 1 entries"):
        advantages_of(obj, batch, data, values=torch.zeros(batch.targets.shape))
    obj = objective(
        hooks_config=HooksConfig(custom_convert_samples_to_train_data_path="my_objective_hooks.convert_short")
    )
    with pytest.raises(CustomHookError, match="--custom-convert-samples-to-train-data-path .*: tokens has 0 entries"):
        obj.train_samples(data)


@pytest.mark.parametrize(
    "algorithm, flag",
    [
        ({"loss_type": "custom_loss"}, "--loss-type"),
        ({"custom_loss_function_path": "m.f"}, "--custom-loss-function-path"),
        ({"use_unbiased_kl": True}, "--use-unbiased-kl"),
        ({"disable_compute_advantages_and_returns": True}, "--disable-compute-advantages-and-returns"),
        (
            {
                "loss_type": "custom_loss",
                "custom_loss_function_path": "m.f",
                "disable_compute_advantages_and_returns": True,
                "custom_advantage_function_path": "m.g",
            },
            "--custom-advantage-function-path",
        ),
        ({"loss_type": "sft_loss", "disable_rewards_normalization": True}, "--disable-rewards-normalization"),
        (
            {
                "loss_type": "custom_loss",
                "custom_loss_function_path": "m.f",
                "custom_pg_loss_reducer_function_path": "m.r",
            },
            "--custom-pg-loss-reducer-function-path",
        ),
        (
            {"loss_type": "custom_loss", "custom_loss_function_path": "m.f", "advantage_estimator": "ppo"},
            "--loss-type",
        ),
    ],
)
def test_combinations_that_would_be_wrong_are_refused_naming_the_flag(algorithm, flag):
    with pytest.raises(ConfigError) as error:
        AlgorithmConfig(**algorithm).validate()
    assert error.value.flag == flag


def test_sft_accepts_disabling_advantages_it_never_computes():
    algo = AlgorithmConfig(loss_type="sft_loss", disable_compute_advantages_and_returns=True)
    algo.validate()
    assert not algo.computes_advantages and dataclasses.asdict(algo)["loss_type"] == "sft_loss"
