"""TorchBackend.train_rollout with every estimator and correction, on a tiny random model (CPU, seconds)."""

import math
import random

import pytest
import torch

from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config.algorithm import AlgorithmConfig
from vime.sample import Sample

GROUP = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("rl_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def response_log_softmax(model, sample):
    """[response_length, vocab] log-probs of the positions predicting the response tokens (temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sample.tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1)[sample.prompt_length - 1 :]


def make_samples(model, *, groups=2, versions=None, top_k=None, seed=0):
    """Ragged samples with rewards, exact sampler log-probs (the model's own) and, optionally, top-k heads."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randint(1, 10) for _ in range(rng.randint(2, 4))] + [11]
        for i in range(GROUP):
            response = [rng.randint(1, 11) for _ in range(rng.randint(2, 6))]
            sample = Sample(
                group_index=g,
                index=i,
                tokens=prompt + response,
                response_length=len(response),
                reward=float(rng.random() < 0.5) + 0.1 * i,
                status=Sample.Status.COMPLETED,
            )
            sample.loss_mask = [1] * len(response)
            sample.loss_mask[min(1, len(response) - 1)] = 0 if i == 2 else 1  # one masked (tool) token
            sample.weight_versions = list(versions[i]) if versions else [0] * len(response)
            sample.weight_versions = (sample.weight_versions * len(response))[: len(response)]
            log_softmax = response_log_softmax(model, sample)
            sample.rollout_log_probs = log_softmax.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()
            if top_k:
                head = log_softmax.topk(top_k, dim=-1)
                sample.rollout_topk_token_ids, sample.rollout_topk_log_probs = head.indices.numpy(), head.values.numpy()
            samples.append(sample)
    return samples


def backend(model_dir, *, micro_batch_size=4, **algorithm):
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return TorchBackend(
        TorchTrainerSpec(
            hf_checkpoint=model_dir,
            lr=1e-3,
            weight_decay=0.0,
            adam_betas=(0.9, 0.999),
            adam_eps=1e-8,
            clip_grad=1.0,
            micro_batch_size=micro_batch_size,
            global_batch_size=2 * GROUP,
            n_samples_per_prompt=GROUP,
            rollout_temperature=1.0,
            algorithm=algo,
            seed=0,
            threads=1,
        )
    )


ESTIMATORS = {
    "grpo": {},
    "gspo": {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
    "cispo": {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0},
    "reinforce_plus_plus": {
        "advantage_estimator": "reinforce_plus_plus",
        "normalize_advantages": True,
        "kl_coef": 0.01,
        "gamma": 0.99,
    },
    "reinforce_plus_plus_baseline": {
        "advantage_estimator": "reinforce_plus_plus_baseline",
        "normalize_advantages": True,
        "kl_coef": 0.01,
    },
    "grpo_reinforce_dual_entropy": {"pg_loss_type": "reinforce", "entropy_coef": 0.01},
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_one_step_with_each_estimator(model_dir, model, name):
    trainer = backend(model_dir, **ESTIMATORS[name])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_rollout(make_samples(model), policy_version=0)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["optimizer_steps"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    for key in (
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "entropy",
        "train_rollout_logprob_abs_diff",
        "onpolicy_logprob_abs_diff",
        "train_tokens",
        "train_seconds",
    ):
        assert math.isfinite(metrics[key]), key
    # The sampler's log-probs are the model's own: trainer and sampler agree before the step.
    assert metrics["onpolicy_logprob_abs_diff"] < 1e-4
    if "kl_coef" in ESTIMATORS[name]:
        assert metrics["kl"] < 1e-6  # the reference is the initial policy


def test_kl_loss_against_the_reference_model(model_dir, model):
    metrics = backend(model_dir, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3").train_rollout(
        make_samples(model), policy_version=0
    )
    assert abs(metrics["kl"]) < 1e-6 and abs(metrics["kl_loss"]) < 1e-6
    # --ref-load: the actor starts from it as the reference does (the seeds: when --load holds no checkpoint);
    # once the policy has moved away from it, the k3 KL is positive and enters the loss.
    import tempfile

    from transformers import AutoModelForCausalLM

    from vime.tools.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as other:
        make_tiny_model(other, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=5)
        trainer = backend(model_dir, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", ref_load=other)
        expected = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
        assert all(torch.equal(p, expected[n]) for n, p in trainer.model.named_parameters())
        first = trainer.train_rollout(make_samples(model), policy_version=0)
        moved = trainer.train_rollout(make_samples(model, seed=1), policy_version=0)
    assert abs(first["kl"]) < 1e-6
    assert moved["kl"] > 1e-7 and moved["loss"] == pytest.approx(
        moved["pg_loss"] + 0.1 * moved["kl_loss"], rel=1e-4, abs=1e-6
    )


def test_tis_weights_the_loss_by_the_clipped_ratio(model_dir, model):
    plain = backend(model_dir).train_rollout(make_samples(model), policy_version=0)
    samples = make_samples(model)
    for s in samples:  # the sampler claims 5x the trainer's probability: ratio 0.2, clipped up to 0.5
        s.rollout_log_probs = [lp + math.log(5) for lp in s.rollout_log_probs]
    weighted = backend(model_dir, use_tis=True, tis_clip=2.0, tis_clip_low=0.5).train_rollout(samples, 0)
    assert weighted["tis_clipfrac"] == 1.0 and weighted["tis"] == pytest.approx(0.2, rel=1e-4)
    assert weighted["loss"] == pytest.approx(0.5 * plain["loss"], rel=1e-5, abs=1e-7)
    exact = backend(model_dir, use_tis=True).train_rollout(make_samples(model), 0)
    assert exact["tis_clipfrac"] == 0.0 and exact["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)


def test_custom_tis_function_can_reject_tokens(model_dir, model, tmp_path):
    plugin = tmp_path / "reject_all.py"
    plugin.write_text(
        "import torch\n"
        "CALLS = []\n"
        "def reject(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,\n"
        "           response_lengths):\n"
        "    CALLS.append((args.tis_clip, response_lengths))\n"
        "    return pg_loss, [torch.zeros_like(m) for m in loss_masks], {'rejected': torch.ones_like(pg_loss)}\n"
    )
    trainer = backend(model_dir, use_tis=True, custom_tis_function_path=f"{plugin}:reject")
    samples = make_samples(model)
    metrics = trainer.train_rollout(samples, 0)
    assert metrics["loss"] == 0 and metrics["grad_norm"] == 0 and metrics["rejected"] == 1.0
    import sys

    calls = sys.modules["vime_plugin_reject_all"].CALLS
    assert calls[0] == (2.0, [s.response_length for s in samples[:4]])


def test_mask_offpolicy_trains_exactly_like_zeroed_loss_masks(model_dir, model):
    versions = [[3, 3, 4], [4], [3], [2, 4, 4, 4, 4, 4]]  # per sample in a group, repeated to its length
    masked = make_samples(model, versions=versions)
    metrics = backend(model_dir, mask_offpolicy_in_partial_rollout=True).train_rollout(masked, policy_version=4)
    by_hand = make_samples(model, versions=versions)
    expected_masked = 0
    for s in by_hand:
        for t, version in enumerate(s.weight_versions):
            if version < 4 and s.loss_mask[t]:
                s.loss_mask[t] = 0
                expected_masked += 1
    reference = backend(model_dir).train_rollout(by_hand, policy_version=4)
    assert metrics["offpolicy_masked_tokens"] == expected_masked > 0
    assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-6)
    with pytest.raises(ValueError, match="policy version"):
        backend(model_dir, mask_offpolicy_in_partial_rollout=True).train_rollout(masked, policy_version=None)


def test_sft_loss_is_the_token_mean_negative_log_likelihood(model_dir, model):
    samples = make_samples(model)
    for s in samples:
        s.reward = None  # SFT does not need rewards
    metrics = backend(model_dir, loss_type="sft_loss", calculate_per_token_loss=True).train_rollout(samples, 0)
    # Reference: Hugging Face's own causal-LM loss with labels only on the loss-masked response tokens.
    length = max(len(s.tokens) for s in samples)
    input_ids = torch.zeros((len(samples), length), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, s in enumerate(samples):
        input_ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        attention[row, : len(s.tokens)] = 1
        for t, (token, keep) in enumerate(zip(s.response_tokens, s.loss_mask)):
            if keep:
                labels[row, s.prompt_length + t] = token
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.item()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert "pg_clipfrac" not in metrics


def test_score_centering_is_zero_when_the_sampler_is_the_trainer(model_dir, model):
    samples = make_samples(model, top_k=4)
    metrics = backend(
        model_dir, use_score_centering=True, score_centering_top_k=4, calculate_per_token_loss=True
    ).train_rollout(samples, 0)
    assert abs(metrics["sc_correction"]) < 1e-5
    assert metrics["sc_sampler_head_mass"] == pytest.approx(metrics["sc_train_head_mass"], abs=1e-5)
    assert 0 < metrics["sc_train_head_mass"] < 1
    assert metrics["sc_importance_weight"] == 1.0  # no TIS: weight 1
    # A sampler whose head differs from the trainer's gets a correction, and a different loss.
    shifted = make_samples(model, top_k=4)
    for s in shifted:
        s.rollout_topk_log_probs = s.rollout_topk_log_probs - 0.3
    moved = backend(
        model_dir, use_score_centering=True, score_centering_top_k=4, calculate_per_token_loss=True
    ).train_rollout(shifted, 0)
    assert abs(moved["sc_correction"]) > 1e-3 and moved["loss"] != pytest.approx(metrics["loss"])


def test_score_centering_needs_the_heads(model_dir, model):
    with pytest.raises(ValueError, match="top-k heads"):
        backend(model_dir, use_score_centering=True, score_centering_top_k=4).train_rollout(make_samples(model), 0)


def test_tis_needs_rollout_log_probs(model_dir, model):
    samples = make_samples(model)
    samples[3].rollout_log_probs = None
    with pytest.raises(ValueError, match="rollout_log_probs"):
        backend(model_dir, use_tis=True).train_rollout(samples, 0)


def test_per_sample_and_per_token_reductions_differ_on_ragged_batches(model_dir, model):
    per_sample = backend(model_dir, pg_loss_type="reinforce").train_rollout(make_samples(model), 0)
    per_token = backend(model_dir, pg_loss_type="reinforce", calculate_per_token_loss=True).train_rollout(
        make_samples(model), 0
    )
    # REINFORCE's loss is -mean(A log p); recompute both reductions independently from the model.
    from vime.rl.advantages import grpo_advantages

    samples = make_samples(model)
    advantages = grpo_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), GROUP).tolist()
    sample_means, token_sum, token_count = [], 0.0, 0
    for s, a in zip(samples, advantages):
        kept = [-a * lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]
        sample_means.append(sum(kept) / len(kept))
        token_sum += sum(kept)
        token_count += len(kept)
    assert per_sample["loss"] == pytest.approx(sum(sample_means) / len(samples), rel=1e-4)
    assert per_token["loss"] == pytest.approx(token_sum / token_count, rel=1e-4)
