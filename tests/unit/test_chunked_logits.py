"""Activation memory of the torch backend: chunked log-probs (--log-probs-chunk-size) and activation
checkpointing (--recompute-granularity full). Both must change memory only: results and gradients equal
the unchunked, unrecomputed path's, and the saved-for-backward bytes drop by what they claim to save."""

import pytest
import torch

from tests.unit.test_rl_torch_backend import GROUP, make_samples
from vime.backends.chunked_logits import chunked_forward, chunked_token_log_probs
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config.algorithm import AlgorithmConfig

TEMPERATURE = 0.7


def causal_lm(*, vocab_size=64, tied=False, arch="qwen2", hidden_size=32, layers=2, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def ragged_batch(vocab_size, *, rows=2, length=11, k=3, seed=1):
    """Right-padded token ids (the second row shorter), targets and k head ids per position."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (rows, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if rows > 1:
        attention_mask[1, length - 4 :] = 0
        input_ids[1, length - 4 :] = 0
    heads = torch.randint(0, vocab_size, (rows, length - 1, k), generator=generator)
    return input_ids, attention_mask, input_ids[:, 1:], heads


def reference(model, input_ids, attention_mask, targets, heads, temperature):
    """The unchunked computation, written out: whole logits, temperature, log-softmax, gather."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    if temperature > 0:
        logits = logits / temperature
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy, log_softmax.gather(-1, heads)


def weighted_loss(log_probs, entropy, head_log_probs):
    """A loss that weighs every output differently, so each one's gradient is checked."""
    generator = torch.Generator().manual_seed(7)
    w = [torch.randn(t.shape, generator=generator) for t in (log_probs, entropy, head_log_probs)]
    return (w[0] * log_probs).sum() + (w[1] * entropy).sum() + (w[2] * head_log_probs).sum()


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000], ids=["chunk1", "chunk7-non-divisor", "chunk-longer"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_chunked_results_and_gradients_equal_the_unchunked(chunk_size, tied, arch):
    model = causal_lm(tied=tied, arch=arch)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    input_ids, attention_mask, targets, heads = ragged_batch(64)

    expected = reference(model, input_ids, attention_mask, targets, heads, TEMPERATURE)
    weighted_loss(*expected).backward()
    expected_grads = gradients(model)
    model.zero_grad(set_to_none=True)

    out = chunked_forward(
        model,
        {"input_ids": input_ids, "attention_mask": attention_mask},
        targets,
        chunk_size=chunk_size,
        temperature=TEMPERATURE,
        entropy="loss",
        head_ids=heads,
    )
    for got, want in zip((out.log_probs, out.entropy, out.head_log_probs), expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weighted_loss(out.log_probs, out.entropy, out.head_log_probs).backward()
    got_grads = gradients(model)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # The head's gradient is non-trivial (and, tied, it is the embedding's: one tensor, both contributions).
    assert got_grads["lm_head.weight" if not tied else "model.embed_tokens.weight"].abs().sum() > 0


def test_pure_function_with_bias_without_temperature_and_metric_entropy():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, 8, generator=generator, requires_grad=True)
    weight = torch.randn(40, 8, generator=generator, requires_grad=True)
    bias = torch.randn(40, generator=generator, requires_grad=True)
    targets = torch.randint(0, 40, (3, 5), generator=generator)
    for temperature in (0.0, 1.0, 1.3):  # 0: greedy sampling, the logits are not divided
        logits = torch.nn.functional.linear(hidden, weight, bias)
        log_softmax = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
        want = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        want_grads = torch.autograd.grad((want * torch.arange(5.0)).sum(), (hidden, weight, bias))
        out = chunked_token_log_probs(
            hidden, weight, bias, targets, chunk_size=4, temperature=temperature, entropy="metric"
        )
        torch.testing.assert_close(out.log_probs, want)
        # As a metric the entropy is computed but never differentiated.
        assert not out.entropy.requires_grad and out.head_log_probs is None
        torch.testing.assert_close(out.entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach())
        got_grads = torch.autograd.grad((out.log_probs * torch.arange(5.0)).sum(), (hidden, weight, bias))
        for got, grad in zip(got_grads, want_grads):
            torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="--log-probs-chunk-size must be >= 1"):
        chunked_token_log_probs(
            torch.zeros(2, 4), torch.zeros(5, 4), None, torch.zeros(2, dtype=torch.long), chunk_size=0, temperature=1.0
        )


# ---------------------------------------------------------------------- saved-for-backward bytes
class SavedBytes:
    """Bytes autograd keeps for the backward pass while the context is open (each storage counted once)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def test_chunking_saves_at_least_the_logits_for_backward():
    """A large vocabulary (32k) and a few hundred tokens: the logits dominate what autograd saves unchunked."""
    vocab, length = 32_000, 300
    model = causal_lm(vocab_size=vocab, hidden_size=32, layers=1)
    input_ids, attention_mask, targets, heads = ragged_batch(vocab, rows=1, length=length)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    logits_bytes = (length - 1) * vocab * 4

    with SavedBytes() as unchunked:
        expected = reference(model, input_ids, attention_mask, targets, heads, TEMPERATURE)
    weighted_loss(*expected).backward()
    expected_grads = gradients(model)
    model.zero_grad(set_to_none=True)
    del expected
    with SavedBytes() as chunked:
        out = chunked_forward(
            model, inputs, targets, chunk_size=32, temperature=TEMPERATURE, entropy="loss", head_ids=heads
        )
    weighted_loss(out.log_probs, out.entropy, out.head_log_probs).backward()
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)

    print(
        f"saved for backward: unchunked {unchunked.total:,} B, chunked {chunked.total:,} B, logits {logits_bytes:,} B"
    )
    assert unchunked.total - chunked.total >= logits_bytes
    # What chunking keeps is the body's activations and the head's weight, nothing of vocabulary x tokens.
    assert chunked.total < logits_bytes


def test_full_recompute_saves_layer_activations_and_keeps_the_gradients():
    from vime.backends.activation_checkpointing import enable_full_recompute

    model = causal_lm(layers=4, hidden_size=64)
    input_ids, attention_mask, targets, heads = ragged_batch(64, length=64)

    def run():
        with SavedBytes() as saved:
            out = reference(model, input_ids, attention_mask, targets, heads, TEMPERATURE)
        weighted_loss(*out).backward()
        grads = gradients(model)
        model.zero_grad(set_to_none=True)
        return saved.total, grads

    plain_bytes, plain_grads = run()
    enable_full_recompute(model)
    recomputed_bytes, recomputed_grads = run()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print(f"saved for backward: {plain_bytes:,} B without recompute, {recomputed_bytes:,} B with")
    assert recomputed_bytes < plain_bytes


# ---------------------------------------------------------------------- the backend
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("chunked_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def backend(model_dir, *, log_probs_chunk_size=None, recompute_granularity=None, **algorithm):
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
            micro_batch_size=4,
            global_batch_size=2 * GROUP,
            n_samples_per_prompt=GROUP,
            rollout_temperature=0.8,
            algorithm=algo,
            seed=0,
            threads=1,
            log_probs_chunk_size=log_probs_chunk_size,
            recompute_granularity=recompute_granularity,
        )
    )


def assert_same_training(reference_backend, other, samples):
    want = reference_backend.train_rollout(samples, 0)
    got = other.train_rollout(samples, 0)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "ppo_kl", "value_loss", "critic_grad_norm", "sc_correction"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    modules = [(reference_backend.model, other.model)]
    if reference_backend.critic is not None:
        modules.append((reference_backend.critic.module, other.critic.module))
    for a, b in modules:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            # AdamW's first step moves each entry by about lr x sign(gradient): where a gradient entry is
            # near zero, float32 rounding can move it differently, by a small fraction of lr (1e-3); a wrong
            # gradient flips signs and moves entries by ~2 lr.
            torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)
    return want


ALGORITHMS = {
    "grpo_entropy_loss": {"entropy_coef": 0.01},
    "score_centering": {"use_score_centering": True, "score_centering_top_k": 4},
    "sft": {"loss_type": "sft_loss"},
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_train_rollout_with_chunked_log_probs_equals_unchunked(model_dir, model, name):
    samples = make_samples(model, top_k=4)
    algorithm = ALGORITHMS[name]
    plain, chunked = backend(model_dir, **algorithm), backend(model_dir, log_probs_chunk_size=5, **algorithm)
    before = [p.detach().clone() for p in plain.model.parameters()]
    metrics = assert_same_training(plain, chunked, samples)
    assert metrics["grad_norm"] > 0
    # The step moved the weights (by ~lr): equal parameters do not mean nothing was trained.
    assert max(float((p.detach() - b).abs().max()) for p, b in zip(plain.model.parameters(), before)) > 5e-4


def test_train_rollout_with_full_recompute_equals_without(model_dir, model):
    samples = make_samples(model)
    assert_same_training(
        backend(model_dir, entropy_coef=0.01),
        backend(model_dir, recompute_granularity="full", log_probs_chunk_size=3, entropy_coef=0.01),
        samples,
    )


def test_ppo_critic_with_full_recompute_equals_without(model_dir, model):
    samples = make_samples(model)
    plain = backend(model_dir, advantage_estimator="ppo")
    recomputed = backend(model_dir, advantage_estimator="ppo", recompute_granularity="full")
    assert recomputed.critic.module.body.is_gradient_checkpointing and recomputed.model.is_gradient_checkpointing
    metrics = assert_same_training(plain, recomputed, samples)
    assert metrics["critic_grad_norm"] > 0


# ---------------------------------------------------------------------- flags
def test_flags_reach_the_trainer_spec(config_dir):
    from tests.train_args import minimal_train_argv
    from vime.config import parse_train_args
    from workers.trainer_worker import TrainerWorkerSpec

    s = parse_train_args(
        minimal_train_argv(
            config_dir,
            "--log-probs-chunk-size",
            "1024",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        )
    )
    spec = TrainerWorkerSpec.from_settings(s, transport="memory", store=None, threads=1, cpu_affinity=None).backend
    assert (spec.log_probs_chunk_size, spec.recompute_granularity) == (1024, "full")
    default = TrainerWorkerSpec.from_settings(
        parse_train_args(minimal_train_argv(config_dir)), transport="memory", store=None, threads=1, cpu_affinity=None
    ).backend
    assert (default.log_probs_chunk_size, default.recompute_granularity) == (None, None)


@pytest.mark.parametrize(
    "extra, flag, message",
    [
        (["--log-probs-chunk-size", "0"], "--log-probs-chunk-size", "must be >= 1"),
        (["--log-probs-chunk-size", "-1"], "--log-probs-chunk-size", "must be >= 1"),
        (["--recompute-granularity", "selective"], "--recompute-granularity", "'selective'"),
        (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-method", "'block'"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "2"], "--recompute-num-layers", "2"),
    ],
)
def test_bad_values_are_refused_at_start_up_naming_the_flag(config_dir, extra, flag, message):
    from tests.train_args import minimal_train_argv
    from vime.config import ConfigError, parse_train_args

    with pytest.raises(ConfigError) as error:
        parse_train_args(minimal_train_argv(config_dir, *extra))
    assert str(error.value).startswith(f"{flag}: ") and message in str(error.value), str(error.value)
