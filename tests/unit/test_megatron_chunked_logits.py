"""--log-probs-chunk-size on the Megatron backend: the output layer's logits a chunk of tokens at a time, gathered
over the tensor-parallel ranks' vocabulary rows, never for the whole micro-batch. Training must be the same as
with the whole logits: at TP=1 (tied embeddings too), at TP=2 with and without sequence parallelism, on the last
of two pipeline stages and over two context-parallel ranks (gloo ranks), with a padded vocabulary whose padding
rows lie on the second tensor-parallel rank only."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from tests import megatron_shim  # noqa: E402
from tests.gloo_ranks import join_group, leave_group, run_ranks  # noqa: E402
from tests.numerics import ADAMW_WEIGHT_ATOL  # noqa: E402
from tests.unit.test_megatron_backend import (  # noqa: E402
    ALGORITHMS,
    assert_same_metrics,
    make_samples,
    megatron_spec,
    trainer_spec,
    with_heads,
)
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.megatron_model import Parallelism  # noqa: E402
from vime.runtime.ports import free_port  # noqa: E402

# 21 tokens padded to a multiple of 4 x TP: at TP=2 the first rank holds rows 0-11 (all real), the second 12-23
# (three padding rows), so both of VocabParallelHead's gradient branches run.
VOCAB, DIVISIBLE_BY, CHUNK, ROLLOUTS = 21, 4, 5, 2
# The entropy term in the loss and the reference model (KL), and score centering (head log-probs) with TIS.
CHUNKED_ALGORITHMS = ("kl_loss_entropy_reference", "score_centering_tis")


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_hf_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """Tied embeddings: the output layer's weight is the input embedding's, whose gradient adds both uses."""
    return megatron_shim.tiny_hf_model(str(tmp_path_factory.mktemp("tied")), "qwen2", vocab_size=VOCAB, tie=True)


def backend(model_dir: str, algorithm: str, *, chunk: int | None, parallel: Parallelism | None = None):
    spec = dataclasses.replace(trainer_spec(model_dir, **ALGORITHMS[algorithm]), log_probs_chunk_size=chunk)
    overrides = {"parallel": parallel} if parallel is not None else {}
    return MegatronBackend(spec, megatron_spec(model_dir, vocab_divisible_by=DIVISIBLE_BY, **overrides))


def rollout(index: int, algorithm: str):
    samples = make_samples(index)
    return with_heads(samples) if algorithm == "score_centering_tis" else samples


def train(model, algorithm: str) -> list[dict]:
    return [model.train_rollout(rollout(r, algorithm), 0) for r in range(ROLLOUTS)]


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize(
    "algorithm, tied", [(name, False) for name in CHUNKED_ALGORITHMS] + [("kl_loss_entropy_reference", True)]
)
def test_chunked_log_probs_train_as_the_whole_logits_do(model_dir, tied_dir, algorithm, tied):
    folder = tied_dir if tied else model_dir
    whole = backend(folder, algorithm, chunk=None)
    chunked = backend(folder, algorithm, chunk=CHUNK)
    assert chunked.gpt.share_embeddings_and_output_weights == tied
    calls = []
    chunked.gpt.output_layer.register_forward_hook(lambda module, args, output: calls.append(output[0].shape))
    for ours, theirs in zip(train(chunked, algorithm), train(whole, algorithm)):
        assert_same_metrics(ours, theirs)
    assert calls == []  # the output layer's [tokens x vocabulary] logits were never computed
    assert_same_weights(dict(chunked.hf_named_weights()), dict(whole.hf_named_weights()))


def _two_rank_worker(rank: int, port: int, model_dir: str, work: str, parallel: Parallelism, algorithm: str) -> None:
    join_group(rank, port, megatron_shim=True)
    model = backend(model_dir, algorithm, chunk=CHUNK, parallel=parallel)
    metrics = train(model, algorithm)
    weights = {n: t.clone() for n, t in model.hf_named_weights()}
    torch.save({"metrics": metrics, "weights": weights}, os.path.join(work, f"rank{rank}.pt"))
    leave_group()


@pytest.mark.parametrize(
    "parallel",
    [
        Parallelism(tensor=2),
        Parallelism(tensor=2, sequence_parallel=True),
        Parallelism(pipeline=2),
        Parallelism(context=2),
    ],
    ids=["tp2", "tp2-sp", "pp2", "cp2"],
)
def test_chunked_log_probs_on_two_ranks_train_as_one_rank_with_the_whole_logits(model_dir, tmp_path, parallel):
    """Each tensor-parallel rank computes its vocabulary rows' logits: a chunk's log-softmax needs both ranks'
    rows (a rank that normalised over its own rows only, or kept another rank's rows' gradient, would step
    differently), and the hidden states' gradient is the sum of both ranks' shares."""
    algorithm = "kl_loss_entropy_reference"
    reference = backend(model_dir, algorithm, chunk=None)
    expected = train(reference, algorithm)
    run_ranks(_two_rank_worker, (free_port(), model_dir, str(tmp_path), parallel, algorithm), 2)
    first, second = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2))
    for ours, theirs in zip(first["metrics"], expected):
        assert_same_metrics(ours, theirs)
    assert_same_weights(first["weights"], dict(reference.hf_named_weights()))
    assert all(torch.equal(first["weights"][n], second["weights"][n]) for n in first["weights"])


def test_chunking_saves_at_least_the_logits_for_backward(tmp_path):
    """A 32k vocabulary and 300 tokens: unchunked, autograd keeps the output layer's logits (and their float32
    log-softmax) for the backward pass; chunked, nothing of vocabulary x tokens."""
    from tests.unit.test_chunked_logits import SavedBytes
    from vime.rl.batch import pack
    from vime.sample import Sample

    vocab, length = 32_000, 300
    model_dir = megatron_shim.tiny_hf_model(str(tmp_path), "qwen2", vocab_size=vocab, num_layers=1)
    tokens = torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    sample = Sample(tokens=tokens, response_length=length - 10, status=Sample.Status.COMPLETED)
    batch = pack([sample], pad_id=0)
    logits_bytes = (length - 1) * vocab * 4
    saved, results = {}, {}
    for chunk in (None, 32):
        model = backend(model_dir, "kl_loss_entropy_reference", chunk=chunk)
        with SavedBytes() as saved[chunk]:
            out = model.forward(model.model, batch, entropy="loss")
        (out.log_probs.sum() + out.entropy.sum()).backward()
        gradients = (model.gpt.embedding.word_embeddings.weight.grad, model.gpt.output_layer.weight.grad)
        results[chunk] = (out.log_probs.detach(), *(g.clone() for g in gradients))
    print(f"saved for backward: unchunked {saved[None].total:,} B, chunked {saved[32].total:,} B")
    torch.testing.assert_close(results[32], results[None], rtol=1e-4, atol=1e-5)
    assert saved[None].total - saved[32].total >= logits_bytes
    assert saved[32].total < logits_bytes


def test_the_flag_reaches_the_megatron_trainer(model_dir, monkeypatch):
    import vime.config as config
    from tests.train_args import minimal_train_argv
    from vime.config import ConfigError, parse_train_args
    from workers.trainer_worker import TrainerWorkerSpec

    monkeypatch.setattr(config, "check_local_cuda", lambda settings: None)  # this machine has no CUDA
    argv = minimal_train_argv(model_dir, "--train-backend", "megatron", "--log-probs-chunk-size")
    settings = parse_train_args([*argv, "64"])
    worker = TrainerWorkerSpec.from_settings(settings, transport="memory", store=None, threads=1, cpu_affinity=None)
    assert worker.megatron is not None and worker.backend.log_probs_chunk_size == 64
    with pytest.raises(ConfigError, match="^--log-probs-chunk-size: must be >= 1"):
        parse_train_args([*argv, "0"])
