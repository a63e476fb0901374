"""PPO's critic on the Megatron backend (TP=1, CPU through tests/megatron_shim.py): the same numbers as
the torch backend's critic, --num-critic-only-steps, role overrides, critic initialisation and checkpoints."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from test_megatron_backend import assert_same_metrics, make_samples, megatron_spec, trainer_spec  # noqa: E402

from tests import megatron_shim  # noqa: E402
from vime.backends import megatron_critic  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.torch_backend import TorchBackend, pack  # noqa: E402
from vime.rl.advantages import ppo_advantages_and_returns  # noqa: E402
from vime.rl.kl import approx_kl  # noqa: E402

CRITIC_METRICS = ("value_loss", "value_clipfrac", "critic_grad_norm", "value_mean", "return_mean", "critic_lr")


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("megatron_ppo_tiny")))


def ppo(model_dir, *, ckpt_format="torch_dist", **algorithm) -> MegatronBackend:
    return MegatronBackend(
        trainer_spec(model_dir, advantage_estimator="ppo", **algorithm),
        megatron_spec(model_dir, ckpt_format=ckpt_format),
    )


def params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def changed(before, module) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def same_critic(a: MegatronBackend, b: MegatronBackend) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.critic_gpt.parameters(), b.critic_gpt.parameters()))


def without_time(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "train_seconds"}


def test_ppo_matches_the_torch_backends_critic(model_dir):
    """Same body (the actor's weights) and the same head: values, GAE and every metric as the torch backend's."""
    reference = TorchBackend(trainer_spec(model_dir, advantage_estimator="ppo", kl_coef=0.05))
    megatron = MegatronBackend(
        trainer_spec(model_dir, advantage_estimator="ppo", kl_coef=0.05), megatron_spec(model_dir)
    )
    with torch.no_grad():
        for name, param in megatron.critic_gpt.output_layer.named_parameters():
            param.copy_(getattr(reference.critic.module.value_head, name))
    samples = make_samples(0)
    packed = [pack(samples[i : i + 4], megatron.pad_id) for i in range(0, len(samples), 4)]
    with torch.no_grad():
        values = [megatron._values(b) for b in packed]
        for ours, theirs in zip(values, [reference._values(b) for b in packed]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        old = [megatron._log_probs(b) for b in packed]
        ref = [megatron._forward(megatron.ref_model, b).log_probs for b in packed]
    # The inherited GAE is the shared pure function applied to the Megatron critic's values.
    advantages, returns = megatron._advantages(samples, packed, old, ref, values, {})
    rows = lambda tensors: [row for b, t in zip(packed, tensors) for row in b.rows(t)]  # noqa: E731
    kl = [approx_kl(o, r, megatron.spec.algorithm.kl_loss_type) for o, r in zip(rows(old), rows(ref))]
    expected_advantages, expected_returns = ppo_advantages_and_returns(
        torch.tensor([s.reward for s in samples]),
        rows(values),
        rows([b.response_mask for b in packed]),
        kl=kl,
        kl_coef=0.05,
        gamma=megatron.spec.algorithm.gamma,
        lambd=megatron.spec.algorithm.lambd,
    )
    for got, want in ((advantages, expected_advantages), (returns, expected_returns)):
        for a, b in zip(rows(got), want):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-6, atol=1e-6)

    actor, critic = params(megatron.gpt), params(megatron.critic_gpt)
    for rollout in range(2):
        samples = make_samples(rollout)
        ours, theirs = megatron.train_rollout(samples, 0), reference.train_rollout(samples, 0)
        assert_same_metrics(ours, theirs)
        for key in (*CRITIC_METRICS, "loss", "pg_loss", "grad_norm"):
            assert torch.isfinite(torch.tensor(ours[key])), key
        assert ours["critic_only"] == 0.0 and ours["optimizer_steps"] == 1
    assert changed(actor, megatron.gpt) and changed(critic, megatron.critic_gpt)
    with torch.no_grad():  # the trained critics still agree
        torch.testing.assert_close(megatron._values(packed[0]), reference._values(packed[0]), rtol=1e-4, atol=1e-4)
    # Turns: the critic sleeps (without gradients) once it has trained; the actor is awake.
    assert megatron.actor.awake and not megatron.critic.awake
    assert all(p.grad is None for p in megatron.critic_gpt.parameters())


def test_num_critic_only_steps_keeps_the_actor_unchanged(model_dir):
    trainer = ppo(model_dir, num_critic_only_steps=1)
    actor, critic = params(trainer.gpt), params(trainer.critic_gpt)
    first = trainer.train_rollout(make_samples(0), 0)
    assert not changed(actor, trainer.gpt), "the actor must not train during critic-only steps"
    assert changed(critic, trainer.critic_gpt)
    assert first["critic_only"] == 1.0 and first["optimizer_steps"] == 0 and "pg_loss" not in first
    assert trainer.actor.optimizer_steps == 0 and trainer.critic.optimizer_steps == 1
    second = trainer.train_rollout(make_samples(1), 1)
    assert changed(actor, trainer.gpt) and second["critic_only"] == 0.0 and "pg_loss" in second


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_checkpoint_round_trips_the_critic(model_dir, tmp_path, ckpt_format):
    trainer = ppo(model_dir, ckpt_format=ckpt_format, num_critic_only_steps=2)
    trainer.train_rollout(make_samples(0), 0)
    trainer.save_training_state(str(tmp_path / "iter_0000001"))
    assert megatron_critic.is_critic_checkpoint(str(tmp_path / "iter_0000001" / "critic"))

    resumed = ppo(model_dir, ckpt_format=ckpt_format, num_critic_only_steps=2)
    assert not same_critic(trainer, resumed)  # a fresh critic differs ...
    resumed.load_training_state(str(tmp_path / "iter_0000001"))
    assert same_critic(trainer, resumed)  # ... the loaded one does not
    assert resumed.rollouts_trained == 1 and resumed.critic.optimizer_steps == 1
    # Both continue identically: rollout 2 is still critic-only (the count was restored), rollout 3 trains both.
    for version in (1, 2):
        samples = make_samples(version)
        a, b = trainer.train_rollout(samples, version), resumed.train_rollout(samples, version)
        assert a["critic_only"] == float(version == 1)
        assert without_time(a) == without_time(b)
    assert same_critic(trainer, resumed)


def test_a_checkpoint_without_critic_cannot_resume_ppo(model_dir, tmp_path):
    MegatronBackend(trainer_spec(model_dir), megatron_spec(model_dir)).save_training_state(str(tmp_path / "grpo"))
    with pytest.raises(ValueError, match="no critic state"):
        ppo(model_dir).load_training_state(str(tmp_path / "grpo"))


def write_yaml(tmp_path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_role_overrides_and_the_critics_own_checkpoints(model_dir, tmp_path):
    save = tmp_path / "critic_ckpt"
    roles = write_yaml(
        tmp_path,
        f"""
megatron:
  - role: actor
    overrides:
      lr: 1e-6
  - role: critic
    overrides:
      lr: 1e-5
      weight_decay: 0.0
      save: {save}
""",
        "roles.yaml",
    )
    trainer = ppo(model_dir, megatron_config_path=roles)
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-6
    assert trainer.critic.optimizer.param_groups[0]["lr"] == 1e-5
    assert trainer.critic.optimizer.param_groups[0]["weight_decay"] == 0.0
    metrics = trainer.train_rollout(make_samples(0), 0)
    assert metrics["lr"] == 1e-6 and metrics["critic_lr"] == 1e-5
    trainer.save_training_state(str(tmp_path / "run" / "iter_0000001"))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert megatron_critic.is_critic_checkpoint(str(save / "iter_0000001"))

    # A later run's critic starts from that folder (body and head); its optimizer starts fresh.
    reload = write_yaml(tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {save}\n", "load.yaml")
    restarted = ppo(model_dir, megatron_config_path=reload)
    assert same_critic(trainer, restarted) and not restarted.critic.optimizer.state
    assert restarted.optimizer.param_groups[0]["lr"] == 1e-3  # no actor entry: the command line's
    # ... or from a PPO run's own checkpoints (its critic/), here the same weights.
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("1")
    from_run = write_yaml(
        tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {tmp_path / 'run'}\n", "run.yaml"
    )
    assert same_critic(trainer, ppo(model_dir, megatron_config_path=from_run))

    unsupported = write_yaml(
        tmp_path, "megatron:\n  - role: critic\n    overrides:\n      lr_decay_iters: 5\n", "bad.yaml"
    )
    with pytest.raises(Exception, match=r"megatron\[0\]\.overrides\.lr_decay_iters: the Megatron backend"):
        ppo(model_dir, megatron_config_path=unsupported)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_critic_body_from_an_actor_checkpoint_keeps_a_fresh_head(model_dir, tmp_path, ckpt_format):
    """A Megatron checkpoint without a value head (an actor's) gives the critic its body only."""
    from vime.tools.convert_checkpoint import hf_to_megatron

    hf_to_megatron(model_dir, str(tmp_path / "actor"), ckpt_format=ckpt_format)
    load = write_yaml(
        tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {tmp_path / 'actor'}\n", "load.yaml"
    )
    from_checkpoint, from_hf = ppo(model_dir, megatron_config_path=load), ppo(model_dir)
    assert same_critic(from_checkpoint, from_hf)  # the same body, and the same --seed head
    actor = dict(from_hf.gpt.named_parameters())
    for name, param in from_hf.critic_gpt.named_parameters():
        if not name.startswith("output_layer."):
            assert torch.equal(param, actor[name]), name
    assert from_hf.critic_gpt.output_layer.weight.shape == (1, from_hf.megatron.model.hidden_size)


def test_critic_from_a_torch_backend_critic_and_with_tied_embeddings(model_dir, tmp_path):
    """A torch-backend critic checkpoint is a valid critic ``load`` (body and head), and a model with tied
    embeddings gets an untied critic whose values equal the torch backend's."""
    import shutil

    from transformers import AutoModelForCausalLM

    tied = tmp_path / "tied"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tied, safe_serialization=True)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(model_dir, name), tied / name)
    reference = TorchBackend(trainer_spec(str(tied), advantage_estimator="ppo"))
    reference._save_critic(str(tmp_path / "torch_critic"))
    load = write_yaml(
        tmp_path, f"megatron:\n  - role: critic\n    overrides:\n      load: {tmp_path / 'torch_critic'}\n", "load.yaml"
    )
    megatron = MegatronBackend(
        trainer_spec(str(tied), advantage_estimator="ppo", megatron_config_path=load), megatron_spec(str(tied))
    )
    assert megatron.megatron.model.tie_embeddings and megatron.gpt.share_embeddings_and_output_weights
    assert not megatron.critic_gpt.share_embeddings_and_output_weights
    batch = pack(make_samples(0)[:4], megatron.pad_id)
    with torch.no_grad():
        torch.testing.assert_close(megatron._values(batch), reference._values(batch), rtol=1e-5, atol=1e-5)
