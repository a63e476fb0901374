"""--bf16 on the torch backend (vime/backends/precision.py): bf16 model, float32 masters and AdamW state.

The float32 run is the reference: the same samples, the same seed, trained without --bf16. Everything runs on the
tiny random model (CPU, one thread, seconds).
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.gloo_ranks import join_group, leave_group, run_ranks
from tests.unit.test_rl_torch_backend import GROUP, make_samples
from vime.backends.precision import engine_dtype
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config.algorithm import AlgorithmConfig
from vime.runtime.ports import free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("bf16_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def spec(model_dir, *, bf16=True, lr=1e-3, engine_dtype=None, **algorithm):
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=lr,
        weight_decay=0.0,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=4,
        global_batch_size=2 * GROUP,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        algorithm=algo,
        seed=0,
        threads=1,
        bf16=bf16,
        engine_dtype=engine_dtype,
    )


def backend(model_dir, **kwargs):
    return TorchBackend(spec(model_dir, **kwargs))


def masters_by_name(trainer):
    return dict(zip(trainer.actor.masters.names, trainer.actor.masters.params))


def test_parameters_are_bf16_and_masters_and_adam_state_float32(model_dir, model):
    trainer = backend(model_dir, use_kl_loss=True, kl_loss_coef=0.1)
    metrics = trainer.train_rollout(make_samples(model), policy_version=0)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
    masters = list(trainer.actor.parameters())
    assert masters and {m.dtype for m in masters} == {torch.float32}
    # The optimizer steps the masters, and its moments are float32.
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == {id(m) for m in masters}
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # Gradients were summed into the masters in float32; the bf16 copy holds none.
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    assert all(p.grad is None for p in trainer.model.parameters())
    # The bf16 parameters are the masters rounded after the step.
    for p, m in zip(trainer.model.parameters(), masters):
        assert torch.equal(p, m.to(torch.bfloat16))
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl_loss"])
    # The sampler's log-probs came from the float32 model: the bf16 trainer differs, by a bf16-sized amount.
    assert 0 < metrics["train_rollout_logprob_abs_diff"] <= metrics["train_rollout_logprob_abs_diff_max"] < 0.05


def test_first_losses_match_the_float32_run(model_dir, model):
    """SFT (the loss is the token-mean NLL, ~log(12) = 2.5 here, not ~0 as GRPO's at ratio 1), four steps.

    Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.002). The tiny model's logits are O(1), so
    a log-prob computed through bf16 weights and activations is off by a few 1e-3 per token; the mean NLL is off by
    at most the largest per-token gap, and the float32 masters keep the two runs' weights within bf16 rounding of
    each other (no drift beyond it). 1e-2 covers that with room, and is well below the change of the loss over the
    four steps (checked), so a bf16 run that did not learn, or learnt differently, fails."""
    losses = {}
    for bf16 in (False, True):
        trainer = backend(model_dir, bf16=bf16, loss_type="sft_loss", calculate_per_token_loss=True)
        losses[bf16] = [trainer.train_rollout(make_samples(model, seed=0), 0)["loss"] for _ in range(4)]
    assert losses[False][0] - losses[False][-1] > 0.05  # the reference learns: the tolerance is meaningful
    for step, (full, half) in enumerate(zip(losses[False], losses[True])):
        assert abs(full - half) < 1e-2, (step, losses)


def test_masters_keep_an_update_bf16_rounds_away(model_dir, model):
    """lr 1e-6: AdamW's first step moves each weight by ~lr (m/sqrt(v) = sign(g)), far below half a bf16 ulp of
    the tiny model's weights (~1e-4 at 0.02). The masters take the exact float32 update; the bf16 copy cannot."""
    lr, eps = 1e-6, 1e-8
    trainer = backend(model_dir, lr=lr)
    before = {n: m.detach().clone() for n, m in masters_by_name(trainer).items()}
    bf16_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_rollout(make_samples(model), policy_version=0)
    moved = unchanged_bf16 = total = 0
    for name, master in masters_by_name(trainer).items():
        grad = master.grad  # the step's summed float32 gradient (cleared at the next step)
        # AdamW, step 1, no weight decay: w - lr * g / (|g| + eps) (bias corrections cancel).
        expected = before[name] - lr * grad / (grad.abs() + eps)
        torch.testing.assert_close(master.detach(), expected, rtol=0, atol=1e-9)
        moved += int((master != before[name]).sum())
        unchanged_bf16 += int((trainer.model.get_parameter(name) == bf16_before[name]).sum())
        total += master.numel()
    assert moved > 0.9 * total  # the float32 update landed
    # and bf16 rounded most of it away (weights near zero have finer bf16 steps: those few do move)
    assert unchanged_bf16 > 0.9 * total


@pytest.mark.parametrize(
    "vllm_dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16), (None, torch.float32)]
)  # None: the checkpoint's float32
def test_weights_are_exported_from_the_masters_in_the_engine_dtype(model_dir, model, tmp_path, vllm_dtype, expected):
    trainer = backend(model_dir, lr=1e-6, engine_dtype=vllm_dtype)  # tiny steps: masters != their bf16 copy
    trainer.train_rollout(make_samples(model), policy_version=0)
    trainer.save_weights(str(tmp_path / "w"))
    written = load_file(str(tmp_path / "w" / "model.safetensors"))
    with open(tmp_path / "w" / "config.json") as f:
        config = json.load(f)
    assert config["dtype"] == str(expected).removeprefix("torch.")
    masters = masters_by_name(trainer)
    assert set(written) == set(masters)
    for name, tensor in written.items():
        assert tensor.dtype == expected
        assert torch.equal(tensor, masters[name].detach().to(expected)), name
    if expected == torch.float32:  # the engine gets what bf16 would have rounded away
        assert any(not torch.equal(t, trainer.model.get_parameter(n).float()) for n, t in written.items())
    # NCCL publication: the same tensors.
    for name, tensor in trainer.hf_named_weights():
        assert tensor.dtype == expected and torch.equal(tensor, written[name])
    # The bf16 model is untouched by the export.
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


def test_engine_dtype_resolution(model_dir, tmp_path):
    assert engine_dtype("half", model_dir) == torch.float16
    assert engine_dtype("auto", model_dir) == torch.float32  # the tiny model's config.json says float32
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert engine_dtype(None, str(tmp_path)) == torch.bfloat16
    with pytest.raises(ValueError, match="--vllm-dtype"):
        engine_dtype("float8", model_dir)


def test_checkpoint_resumes_with_the_same_next_step_loss(model_dir, model, tmp_path):
    kwargs = {"loss_type": "sft_loss", "lr": 1e-4}  # bf16 rounds a good part of each update away: masters matter
    first = backend(model_dir, **kwargs)
    for seed in (0, 1):
        first.train_rollout(make_samples(model, seed=seed), 0)
    saved_masters = {n: m.detach().clone() for n, m in masters_by_name(first).items()}
    first.save_training_state(str(tmp_path / "ckpt"))
    # The checkpoint holds the float32 masters (not their bf16 rounding).
    written = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    assert all(t.dtype == torch.float32 and torch.equal(t, saved_masters[n]) for n, t in written.items())
    expected = first.train_rollout(make_samples(model, seed=2), 0)

    resumed = backend(model_dir, **kwargs)
    resumed.load_training_state(str(tmp_path / "ckpt"))
    for name, master in masters_by_name(resumed).items():
        assert torch.equal(master, saved_masters[name]), name
        assert torch.equal(resumed.model.get_parameter(name), master.to(torch.bfloat16))
    got = resumed.train_rollout(make_samples(model, seed=2), 0)
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    for name, master in masters_by_name(resumed).items():
        assert torch.equal(master, masters_by_name(first)[name]), name


def test_ppo_critic_trains_in_bf16_with_float32_masters(model_dir, model, tmp_path):
    trainer = backend(model_dir, advantage_estimator="ppo")
    critic = trainer.critic
    assert {p.dtype for p in critic.module.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in critic.parameters()} == {torch.float32}
    metrics = trainer.train_rollout(make_samples(model), policy_version=0)
    for key in ("value_loss", "critic_grad_norm", "value_mean"):
        assert math.isfinite(metrics[key]), key
    assert metrics["critic_grad_norm"] > 0
    for p, m in zip(critic.module.parameters(), critic.parameters()):
        assert torch.equal(p, m.to(torch.bfloat16))
    trainer.save_training_state(str(tmp_path / "ckpt"))
    resumed = backend(model_dir, advantage_estimator="ppo")
    resumed.load_training_state(str(tmp_path / "ckpt"))
    for saved, loaded in zip(critic.parameters(), resumed.critic.parameters()):
        assert torch.equal(saved, loaded)


def test_logprob_abs_diff_max_is_the_worst_token_of_the_rollout(model_dir, model):
    """float32 run, one optimizer step of two micro-batches (every log-prob is taken before the update): the
    sampler's log-probs are the model's own except one token of the second micro-batch, off by 0.5. The mean
    over micro-batches would be ~0.25 and the first micro-batch's max ~0: the max over the rollout is 0.5."""
    samples = make_samples(model)
    samples[-1].rollout_log_probs[0] += 0.5  # its first response token is trained (loss_mask 1)
    metrics = backend(model_dir, bf16=False).train_rollout(samples, policy_version=0)
    assert metrics["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert metrics["train_rollout_logprob_abs_diff"] < 0.1


# ---------------------------------------------------------------------- two data-parallel ranks over gloo


def _rank(rank: int, port: int, model_dir: str, work: str) -> None:
    join_group(rank, port)
    from transformers import AutoModelForCausalLM

    from tests.unit.test_bf16_training import masters_by_name, spec
    from tests.unit.test_rl_torch_backend import make_samples

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trainer = TorchBackend(spec(model_dir))
    assert trainer.dp.size == 2
    metrics = [trainer.train_rollout(make_samples(reference, seed=seed), 0) for seed in (0, 1)]
    torch.save(
        {"metrics": metrics, "masters": {n: m.detach().clone() for n, m in masters_by_name(trainer).items()}},
        os.path.join(work, f"rank{rank}.pt"),
    )
    leave_group()


def test_two_data_parallel_ranks_take_the_one_rank_steps(model_dir, model, tmp_path):
    """Each step's two micro-batches go one to each rank; their bf16 gradients are summed in float32 on the masters
    (a + b either way): the ranks' masters and metrics equal the single rank's."""
    run_ranks(_rank, (free_port(), model_dir, str(tmp_path)), 2)
    single = backend(model_dir)
    expected = [single.train_rollout(make_samples(model, seed=seed), 0) for seed in (0, 1)]
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for got, want in zip(result["metrics"], expected):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        for name, master in masters_by_name(single).items():
            torch.testing.assert_close(result["masters"][name], master.detach(), rtol=0, atol=1e-7)


def test_tied_embeddings_stay_tied_through_export_and_checkpoint(model_dir, model, tmp_path):
    """A tied LM head is one parameter in two modules: one master, swapped in both places while saving."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tied_dir = str(tmp_path / "tied")
    tied = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.save_pretrained(tied_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tied_dir)
    trainer = backend(tied_dir, engine_dtype="float32")
    head, embed = trainer.model.get_output_embeddings(), trainer.model.get_input_embeddings()
    assert head.weight is embed.weight and len(trainer.actor.masters.params) == len(list(trainer.model.parameters()))
    trainer.train_rollout(make_samples(model), policy_version=0)
    trainer.save_weights(str(tmp_path / "w"))
    assert head.weight is embed.weight and head.weight.dtype == torch.bfloat16
    written = load_file(str(tmp_path / "w" / "model.safetensors"))
    master = masters_by_name(trainer)["model.embed_tokens.weight"]
    assert torch.equal(written["model.embed_tokens.weight"], master.detach())
    trainer.save_training_state(str(tmp_path / "ckpt"))
    resumed = backend(tied_dir, engine_dtype="float32")
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert torch.equal(masters_by_name(resumed)["model.embed_tokens.weight"], master)
    assert resumed.model.get_output_embeddings().weight is resumed.model.get_input_embeddings().weight
