"""Sequence packing on the torch backend (vime/backends/sequence_packing.py): a micro-batch's sequences run back
to back in one row, with their own position ids and attention confined to each, instead of right-padded rows.

The padded rows are the reference: the same samples trained with ``backend.packing = False``. The forwards give
the same log-probs, entropy, head log-probs and values (sdpa and eager, Qwen2 and Llama, chunked log-probs);
training gives the same losses, gradient norms and updated weights (with the critic, activation checkpointing,
bf16); and the model runs on ``sum(lengths)`` tokens, not ``rows x longest``.
"""

import logging
import random

import pytest
import torch

from tests.unit.test_dynamic_batching import (
    GROUP,
    STEP_METRICS,
    assert_same_params,
    make_samples,
    spec,
    with_extras,
)
from vime.backends import sequence_packing
from vime.backends.sequence_packing import PackedSequences, PaddedRows, forward_layout, packing_refusal
from vime.backends.torch_backend import TorchBackend
from vime.rl.batch import pack
from vime.sample import Sample


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp(f"packing_{request.param}")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        arch=request.param,
    )


def backend(
    model_dir, *, packing: bool, attention: str = "sdpa", chunk: int | None = None, bf16: bool = False, **kwargs
) -> TorchBackend:
    trainer_spec = spec(model_dir, **kwargs)
    trainer_spec.log_probs_chunk_size, trainer_spec.bf16 = chunk, bf16
    trainer = TorchBackend(trainer_spec)
    assert trainer.packing  # every model of the tiny runs can be packed
    trainer.packing = packing
    for model in (trainer.model, trainer.ref_model, trainer.critic and trainer.critic.module.body):
        if model is not None:
            model.config._attn_implementation = attention
    return trainer


# ---------------------------------------------------------------------- the layout maps
def test_packed_row_positions_and_maps_by_hand():
    samples = [
        Sample(tokens=[5, 6, 7], response_length=1),
        Sample(tokens=[1, 2, 3, 4, 9], response_length=2),
        Sample(tokens=[8, 3], response_length=1),
    ]
    batch = pack(samples, pad_id=0)
    assert batch.input_ids.shape == (3, 5)
    seqs = PackedSequences(batch)
    assert seqs.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9, 8, 3]]
    assert seqs.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    # Each sequence's last position (2, 7, 9) predicts nothing of its own.
    assert seqs.predicting_positions.tolist() == [0, 1, 3, 4, 5, 6, 8]
    assert seqs.gather(batch.targets).tolist() == [6, 7, 2, 3, 4, 9, 3]
    # The packed row's states at the predicting positions predict the targets gathered from the padded layout.
    assert seqs.predicting(seqs.input_ids.roll(-1, dims=1)).tolist() == seqs.gather(batch.targets).tolist()
    values = torch.arange(1.0, 8.0, requires_grad=True)
    padded = seqs.scatter(values)
    assert padded.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0]]
    assert [row.tolist() for row in batch.rows(padded)] == [[2.0], [5.0, 6.0], [7.0]]
    padded.sum().backward()  # the scatter is differentiable
    assert values.grad.tolist() == [1.0] * 7


def test_models_that_cannot_be_packed_are_named():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=16, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    config.num_hidden_layers, config.intermediate_size = 1, 32
    model = AutoModelForCausalLM.from_config(config)
    assert packing_refusal(model) is None
    model.config._attn_implementation = "a_kernel_of_mine"
    assert "a_kernel_of_mine" in packing_refusal(model)

    class Custom(torch.nn.Module):  # remote code: transformers does not build its mask
        config = model.config

        def forward(self, input_ids, position_ids=None):
            return input_ids

    model.config._attn_implementation = "sdpa"
    assert "does not build its attention mask" in packing_refusal(Custom())


def test_models_that_carry_state_along_the_sequence_are_not_packed():
    """A gated delta net (Qwen3-Next's linear attention) runs its recurrence and its causal convolution along the
    row: packed, one sequence's state would flow into the next, which no attention mask stops. A model with such
    layers runs right-padded; its log-probs then equal the sequences' own (right padding comes after them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.megatron_shim import MOE_VARIANTS

    fields = {k: v for k, v in MOE_VARIANTS["qwen3_next"].items() if k != "family"}
    config = AutoConfig.for_model(
        "qwen3_next",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        **fields,
    )
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert "linear_attention layers mix tokens beyond what the packed mask confines" in packing_refusal(model)
    # what packing would do: the second sequence's log-probs change when the first precedes it in one row
    first, second = torch.tensor([[3, 5, 7, 9, 11]]), torch.tensor([[2, 4, 6, 8]])
    with torch.no_grad():
        alone = model(input_ids=second).logits[0]
        packed = model(
            input_ids=torch.cat([first, second], 1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
        )
    assert not torch.allclose(packed.logits[0, 5:], alone, atol=1e-4)
    config.layer_types = ["full_attention", "full_attention"]  # (the modules stay: their convolution is found)
    assert "convolution model.layers.0.linear_attn.conv1d" in packing_refusal(model)


def _uniform_and_one_long(count: int, length: int) -> tuple:
    same = [Sample(tokens=[1] * length, response_length=length // 2) for _ in range(count)]
    ragged = [Sample(tokens=[1] * (length // 10), response_length=length // 20) for _ in range(count - 1)]
    return pack(same, pad_id=0), pack([*ragged, same[0]], pad_id=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_attention_2"])
def test_dense_attention_packs_only_where_it_costs_less(attention):
    """Qwen2-7B's shapes: eight samples of 4096 tokens pad nothing, and packed they would attend 8 x more token
    pairs under a dense block-diagonal mask, so eager and sdpa keep them padded; seven of 409 tokens beside one of
    4096 pack. Flash attention's varlen kernels attend each sequence alone: it always packs."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, vocab_size=152064, num_hidden_layers=28)
    config._attn_implementation = attention
    uniform, one_long = _uniform_and_one_long(8, 4096)
    assert isinstance(forward_layout(one_long, True, config), PackedSequences)
    assert isinstance(
        forward_layout(uniform, True, config), PackedSequences if attention.startswith("flash") else PaddedRows
    )
    assert isinstance(forward_layout(one_long, False, config), PaddedRows)  # the models cannot be packed


# ---------------------------------------------------------------------- the forwards
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_packed_forward_equals_the_padded_one(model_dir, attention, chunk):
    kwargs = {"use_score_centering": True, "score_centering_top_k": 3, "advantage_estimator": "ppo", "kl_coef": 0.05}
    packed, padded = (backend(model_dir, packing=p, attention=attention, chunk=chunk, **kwargs) for p in (True, False))
    samples = with_extras(make_samples(0, long_response=40))
    batch = pack(samples[:6], packed.pad_id, with_heads=True)
    trained = batch.response_mask > 0
    for entropy in ("loss", "metric"):
        ours = packed.forward(packed.model, batch, entropy=entropy, heads=True)
        theirs = padded.forward(padded.model, batch, entropy=entropy, heads=True)
        for a, b in ((ours.log_probs, theirs.log_probs), (ours.entropy, theirs.entropy)):
            assert a.shape == b.shape == batch.targets.shape
            assert torch.allclose(a[trained], b[trained], atol=1e-5, rtol=1e-5)
        assert torch.allclose(ours.head_log_probs[trained], theirs.head_log_probs[trained], atol=1e-5)
    values = packed.critic_values(batch), padded.critic_values(batch)
    assert torch.allclose(values[0][trained], values[1][trained], atol=1e-5)


# ---------------------------------------------------------------------- training
RUNS = {
    "grpo_kl_entropy": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
    "ppo": {"advantage_estimator": "ppo", "kl_coef": 0.05},
    "score_centering_opd": {"use_score_centering": True, "score_centering_top_k": 3, "use_opd": True},
    "per_token_chunked_recompute": {"calculate_per_token_loss": True, "chunk": 5, "recompute": True},
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_packed_training_takes_the_padded_steps(model_dir, name, monkeypatch):
    """Two rollouts of two optimizer steps each, with token budgets (so micro-batches mix short and long samples):
    the same losses, gradient norms and updated weights as the padded rows, within float32 rounding."""
    packed_rows = []

    class Counted(PackedSequences):
        def __init__(self, batch):
            super().__init__(batch)
            packed_rows.append(self.tokens)

    monkeypatch.setattr(sequence_packing, "PackedSequences", Counted)
    algorithm = dict(RUNS[name])
    chunk = algorithm.pop("chunk", None)
    recompute = algorithm.pop("recompute", False)
    trainers = []
    for packing in (True, False):
        trainer = backend(model_dir, packing=packing, chunk=chunk, max_tokens=60, forward_tokens=45, **algorithm)
        if recompute:
            from vime.backends.activation_checkpointing import enable_full_recompute

            enable_full_recompute(trainer.model)
            if trainer.critic is not None:
                enable_full_recompute(trainer.critic.module.body)
        trainers.append(trainer)
    ours, theirs = trainers
    initial = [p.detach().clone() for p in theirs.model.parameters()]
    critic_initial = None if theirs.critic is None else [p.detach().clone() for p in theirs.critic.module.parameters()]
    for rollout in range(2):
        samples = with_extras(make_samples(rollout, long_response=40))
        got = ours.train_rollout(samples, 0)
        assert packed_rows, "no micro-batch ran packed"
        packed_rows.clear()
        expected = theirs.train_rollout(samples, 0)
        assert not packed_rows
        assert expected["optimizer_steps"] == 2 and expected["train_micro_batches"] > 2
        for metric in (*STEP_METRICS, "entropy", "ppo_kl", "train_rollout_logprob_abs_diff"):
            assert (metric in got) == (metric in expected), metric
            if metric in expected:
                assert got[metric] == pytest.approx(expected[metric], rel=1e-4, abs=1e-6), metric
        assert_same_params(ours.model, theirs.model, initial)
        if theirs.critic is not None:
            assert_same_params(ours.critic.module, theirs.critic.module, critic_initial)


def test_bf16_packed_training_stays_within_bf16_rounding_of_the_padded(model_dir):
    """bf16 matmuls round differently over other shapes: the losses agree to bf16's precision, not float32's."""
    packed, padded = (backend(model_dir, packing=p, max_tokens=60, bf16=True) for p in (True, False))
    for trainer in (packed, padded):
        assert trainer.model.dtype == torch.bfloat16
    samples = make_samples(0, long_response=40)
    got, expected = packed.train_rollout(samples, 0), padded.train_rollout(samples, 0)
    for metric in ("loss", "pg_loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert got[metric] == pytest.approx(expected[metric], rel=2e-2, abs=2e-3), metric


def _record_shapes(model, layer_tokens: list, logits_numel: list) -> list:
    """Hooks appending the (rows, tokens) that reach ``model``'s first decoder layer and its logits' size."""

    def layer(_, args, kwargs):
        layer_tokens.append(tuple((args[0] if args else kwargs["hidden_states"]).shape[:2]))

    return [
        model.model.layers[0].register_forward_pre_hook(layer, with_kwargs=True),
        model.register_forward_hook(lambda module, args, output: logits_numel.append(output.logits.numel())),
    ]


def test_one_long_response_no_longer_pads_every_row(model_dir):
    """A micro-batch of eight samples, one with a response ten times longer than the others': the model runs on
    sum(lengths) tokens (its activations and logits), where the padded rows ran rows x longest."""
    rng = random.Random(3)
    samples = []
    for i in range(2 * GROUP):
        n = 50 if i == 1 else 5
        response = [rng.randint(1, 11) for _ in range(n)]
        sample = Sample(
            group_index=i // GROUP,
            index=i % GROUP,
            tokens=[3, 4, 5, 11] + response,
            response_length=n,
            reward=float(i % 2),
            status=Sample.Status.COMPLETED,
        )
        sample.rollout_log_probs = [-2.0] * n
        samples.append(sample)
    lengths = [len(s.tokens) for s in samples]
    assert max(lengths) - 4 == 10 * (sorted(lengths)[-2] - 4)
    per_run = {}
    for packing in (True, False):
        trainer = backend(model_dir, packing=packing, micro_batch_size=2 * GROUP)
        layer_tokens, logits_numel = [], []
        hooks = _record_shapes(trainer.model, layer_tokens, logits_numel)
        per_run[packing] = trainer.train_rollout(samples, 0)
        for hook in hooks:
            hook.remove()
        vocab = trainer.model.config.vocab_size
        # Two forwards: the old log-probs (no gradient) and the training one, each of the one micro-batch.
        if packing:
            assert layer_tokens == [(1, sum(lengths))] * 2
            assert logits_numel == [(sum(lengths) - len(samples)) * vocab] * 2  # each sequence's last predicts nothing
        else:
            assert layer_tokens == [(len(samples), max(lengths))] * 2
            assert logits_numel == [len(samples) * max(lengths) * vocab] * 2
    assert sum(lengths) * 3 < len(samples) * max(lengths)
    for metric in ("loss", "pg_loss", "grad_norm"):
        assert per_run[True][metric] == pytest.approx(per_run[False][metric], rel=1e-4, abs=1e-6), metric


def test_a_model_that_cannot_be_packed_trains_padded_and_says_so_once(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(sequence_packing, "PACKABLE_ATTENTION", frozenset())
    with caplog.at_level(logging.WARNING, logger="vime.backends.sequence_packing"):
        trainer = TorchBackend(spec(model_dir, advantage_estimator="ppo", kl_coef=0.05, use_kl_loss=True))
        trainer.train_rollout(make_samples(0), 0)
    assert not trainer.packing
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "right-padded" in warnings[0] and "'sdpa'" in warnings[0], warnings
