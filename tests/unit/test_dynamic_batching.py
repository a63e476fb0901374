"""Token budgets (--use-dynamic-batch-size, --max-tokens-per-gpu): the packing itself, training that does not
depend on it (same losses, gradient norms and weights as fixed micro-batches), two data-parallel ranks with
--balance-data, the Megatron backend, and the start-up checks of the flags."""

import logging
import os
import random

import numpy as np
import pytest
import torch

from tests.gloo_ranks import join_group, leave_group, run_ranks
from tests.train_args import minimal_train_argv as base
from vime.backends.micro_batches import (
    assign_to_ranks,
    dynamic_layout,
    fixed_layout,
    over_budget,
    pack_by_tokens,
    pack_consecutive,
    regroup,
    split_to_multiple,
)
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config import ConfigError, parse_train_args
from vime.config.algorithm import AlgorithmConfig
from vime.runtime.ports import free_port
from vime.sample import Sample

GROUP = 4


# ---------------------------------------------------------------------- the packing (pure functions)
def _covers_once(micro_batches, count):
    flat = sorted(i for mb in micro_batches for i in mb)
    return flat == list(range(count))


@pytest.mark.parametrize("budget", [1, 7, 20, 64, 1000])
def test_first_fit_decreasing_respects_the_budget_and_places_every_sample_once(budget):
    rng = random.Random(budget)
    lengths = [rng.randint(1, 40) for _ in range(37)]
    bins = pack_by_tokens(lengths, budget)
    assert _covers_once(bins, len(lengths))
    for mb in bins:
        load = sum(lengths[i] for i in mb)
        assert load <= budget or len(mb) == 1, (mb, load)  # only a sample longer than the budget overflows
        assert mb == sorted(mb)
    assert pack_by_tokens(lengths, budget) == bins  # deterministic
    # First-fit: no two micro-batches could have been merged into one within the budget (only fewer bins
    # are possible by other orders). FFD's known bound: at most 11/9 of the optimum + 1 bins; check against
    # the trivial lower bound, the total tokens over the budget.
    if budget >= 40:
        loads = sorted(sum(lengths[i] for i in mb) for mb in bins)
        assert loads[0] + loads[1] > budget if len(loads) > 1 else True
        assert len(bins) <= 11 / 9 * -(-sum(lengths) // budget) + 1


def test_first_fit_decreasing_by_hand():
    # Sorted: 9 (0), 6 (2), 5 (1), 4 (3), 2 (4), 1 (5); budget 10: [9, 1], [6, 4], [5, 2].
    assert pack_by_tokens([9, 5, 6, 4, 2, 1], 10) == [[0, 5], [2, 3], [1, 4]]


def test_a_sample_longer_than_the_budget_is_alone():
    lengths = [3, 50, 4, 2]
    bins = pack_by_tokens(lengths, 10)
    assert [1] in bins and all(1 not in mb for mb in bins if mb != [1])
    assert over_budget(lengths, 10) == [1]
    assert pack_consecutive(lengths, 10) == [[0], [1], [2, 3]]


def test_consecutive_packing_keeps_the_rollout_order():
    lengths = [4, 4, 4, 9, 1, 1, 8]
    batches = pack_consecutive(lengths, 9)
    assert batches == [[0, 1], [2], [3], [4, 5], [6]]
    assert [i for mb in batches for i in mb] == list(range(len(lengths)))


def test_steps_are_global_batches_of_samples_and_micro_batches_stay_inside_them():
    lengths = [5, 30, 7, 7, 2, 12, 3, 40, 9, 1]
    layout = dynamic_layout(lengths, global_batch_size=4, max_tokens=16, forward_max_tokens=32)
    assert len(layout.steps) == 3  # 4 + 4 + 2 samples
    for k, step in enumerate(layout.steps):
        assert sorted(i for mb in step for i in mb) == list(range(4 * k, min(4 * k + 4, len(lengths))))
    assert [len(r) for r in layout.step_ranges()] == [len(s) for s in layout.steps]
    assert layout.forward == pack_consecutive(lengths, 32)


def test_fixed_layout_is_the_micro_batch_size_chunks():
    layout = fixed_layout(10, micro_batch_size=3, global_batch_size=6)
    assert layout.forward == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert layout.steps == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9]]]
    assert layout.train == layout.forward


def test_ranks_get_micro_batches_balanced_by_tokens():
    counts = [10, 3, 8, 2, 7]
    owners = assign_to_ranks(counts, 2)
    loads = [sum(c for c, o in zip(counts, owners) if o == r) for r in range(2)]
    assert loads == [15, 15]  # largest first: 10->0, 8->1, 7->1 (15), 3->0 (13), 2->0 (15)
    assert owners == [0, 0, 1, 0, 1]
    assert assign_to_ranks([5], 3) == [0]  # ranks 1 and 2 have nothing this step


def test_equal_counts_give_every_rank_its_share_balanced_by_tokens():
    counts = [10, 3, 8, 2, 7, 1]
    owners = assign_to_ranks(counts, 2, equal_counts=True)
    assert [owners.count(r) for r in range(2)] == [3, 3]
    # largest first: 10->0, 8->1, 7->1 (15), 3->0 (13), 2->0 (15: rank 0 has its three), 1->1 (16)
    assert owners == [0, 0, 1, 0, 1, 1]
    assert assign_to_ranks(counts, 2) != owners  # unconstrained, rank 0 would take four
    with pytest.raises(ValueError, match="5 micro-batches cannot be shared equally by 2 ranks"):
        assign_to_ranks(counts[:5], 2, equal_counts=True)


def test_micro_batches_split_to_a_multiple_of_the_ranks():
    lengths = [5, 5, 5, 9]
    assert split_to_multiple([[0, 1, 2], [3]], lengths, 2) == [[0, 1, 2], [3]]  # already even
    # The largest splittable one (15 tokens) first, at its best halving point, in place; then again.
    assert split_to_multiple([[0, 1, 2], [3]], lengths, 4) == [[0], [1], [2], [3]]
    assert split_to_multiple([[0, 1, 2], [3]], lengths, 3) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="2 sample\\(s\\) cannot make 4 micro-batches"):
        split_to_multiple([[0], [1]], lengths, 4)


@pytest.mark.parametrize("multiple", [2, 3, 4])
def test_a_layout_of_equal_shares_keeps_every_sample_once_within_the_budgets(multiple):
    rng = random.Random(multiple)
    lengths = [rng.randint(3, 40) for _ in range(40)]  # steps of 12, 12, 12 and 4 samples
    layout = dynamic_layout(lengths, 12, max_tokens=60, forward_max_tokens=90, multiple=multiple)
    plain = dynamic_layout(lengths, 12, max_tokens=60, forward_max_tokens=90)
    assert len(layout.forward) % multiple == 0 and all(len(step) % multiple == 0 for step in layout.steps)
    assert sorted(i for b in layout.forward for i in b) == list(range(40))
    assert [i for b in layout.forward for i in b] == list(range(40))  # still consecutive, in rollout order
    for step, plain_step in zip(layout.steps, plain.steps, strict=True):
        assert sorted(i for b in step for i in b) == sorted(i for b in plain_step for i in b)  # the same samples
        for batch in step:  # a part of a micro-batch that met the budget meets it (or is a lone long sample)
            assert sum(lengths[i] for i in batch) <= 60 or len(batch) == 1
    for batch in layout.forward:
        assert sum(lengths[i] for i in batch) <= 90 or len(batch) == 1


def test_regroup_moves_items_between_layouts():
    values = [["a0", "a1"], ["a2"]]
    assert regroup(values, [[0, 1], [2]], [[2, 0], [1]]) == [["a2", "a0"], ["a1"]]


# ---------------------------------------------------------------------- training does not depend on the packing
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("dynbatch_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )


def make_samples(seed: int, groups: int = 4, long_response: int | None = None) -> list[Sample]:
    """Ragged samples with rewards and sampler log-probs; ``long_response``: sample 1 of group 0 gets a
    response of that many tokens."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randint(1, 10) for _ in range(rng.randint(2, 4))] + [11]
        for i in range(GROUP):
            n = long_response if (long_response and g == 0 and i == 1) else rng.randint(2, 7)
            response = [rng.randint(1, 11) for _ in range(n)]
            sample = Sample(
                group_index=g,
                index=i,
                tokens=prompt + response,
                response_length=n,
                reward=float(rng.random() < 0.5) + 0.1 * i,
                status=Sample.Status.COMPLETED,
            )
            sample.loss_mask = [1] * n
            sample.loss_mask[min(1, n - 1)] = 0 if i == 2 else 1
            sample.weight_versions = [0] * n
            sample.rollout_log_probs = [-2.0 - 0.1 * rng.random() for _ in response]
            samples.append(sample)
    return samples


def spec(
    model_dir,
    *,
    micro_batch_size=4,
    global_batch_size=2 * GROUP,
    max_tokens=None,
    forward_tokens=None,
    balance=False,
    **algorithm,
) -> TorchTrainerSpec:
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=1e-3,
        weight_decay=0.01,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        algorithm=algo,
        seed=0,
        threads=1,
        use_dynamic_batch_size=max_tokens is not None,
        max_tokens_per_gpu=max_tokens,
        log_probs_max_tokens_per_gpu=forward_tokens,
        balance_data=balance,
    )


# What the packing must not change: step sums (losses), gradient norms, the schedule. Means of per-micro-batch
# token averages (entropy, clip fractions) are packing-dependent diagnostics and not compared.
STEP_METRICS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "grad_norm",
    "value_loss",
    "critic_grad_norm",
    "lr",
    "critic_lr",
    "optimizer_steps",
    "train_tokens",
)


def assert_same_steps(ours: dict, theirs: dict) -> None:
    for name in STEP_METRICS:
        assert (name in ours) == (name in theirs), name
        if name in theirs:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, initial: list[torch.Tensor]) -> None:
    """The same update up to float32 rounding. Other paddings round the matmuls differently, and Adam moves a
    weight by ~lr per step whatever the size of its gradient, so rounding noise on a near-zero gradient moves a
    few weights by ~1e-5 (fixed micro-batches of 1 and of 4 samples differ as much); a wrong packing (a
    sample's advantage on another's tokens, a micro-batch trained twice) changes the whole update."""
    ours = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(a.parameters(), initial)])
    theirs = torch.cat([(q.detach() - p0).flatten() for q, p0 in zip(b.parameters(), initial)])
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-3
    assert float((ours - theirs).abs().max()) < 1e-4  # a tenth of one step of lr = 1e-3


RUNS = {
    "grpo": {},
    "per_token_loss": {"calculate_per_token_loss": True},
    "kl_loss_entropy": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
    "ppo": {"advantage_estimator": "ppo", "kl_coef": 0.05},
    "sft": {"loss_type": "sft_loss"},
    "gspo_tis": {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "use_tis": True},
    "rollout_logprobs": {"use_rollout_logprobs": True},
    "opd": {"use_opd": True, "opd_kl_coef": 0.5},
    "score_centering": {"use_score_centering": True, "score_centering_top_k": 3},
}


def with_extras(samples: list[Sample]) -> list[Sample]:
    """The sampler's top-k heads (score centering) and a teacher's log-probs (OPD) at each response token."""
    rng = random.Random(7)
    for sample in samples:
        ids = [rng.sample(range(12), 3) for _ in range(sample.response_length)]
        sample.rollout_topk_token_ids = np.array(ids)
        sample.rollout_topk_log_probs = np.array([[-0.5 - 0.7 * j - 0.1 * rng.random() for j in range(3)] for _ in ids])
        sample.teacher_log_probs = [-1.5 - 0.05 * (t % 3) for t in range(sample.response_length)]
    return samples


@pytest.mark.parametrize("name", sorted(RUNS))
def test_dynamic_micro_batches_train_as_fixed_ones(model_dir, name):
    """16 samples, global batch 8 (two steps): fixed micro-batches of 4 against token budgets from one sample
    per micro-batch (budget 1: every sample alone) to one micro-batch per step, with different budgets for the
    no-gradient forwards."""
    algorithm = RUNS[name]
    fixed = TorchBackend(spec(model_dir, **algorithm))
    initial = [p.detach().clone() for p in fixed.model.parameters()]
    critic_initial = None if fixed.critic is None else [p.detach().clone() for p in fixed.critic.module.parameters()]
    budgets = [(1, None), (20, 7), (45, 1000), (10_000, 30)]
    dynamic = [TorchBackend(spec(model_dir, max_tokens=m, forward_tokens=f, **algorithm)) for m, f in budgets]
    for rollout in range(2):
        samples = with_extras(make_samples(rollout))
        expected = fixed.train_rollout(samples, 0)
        assert expected["optimizer_steps"] == 2 and expected["train_micro_batches"] == 4
        for (budget, _), backend in zip(budgets, dynamic):
            got = backend.train_rollout(samples, 0)
            assert_same_steps(got, expected)
            if budget == 1:
                assert got["train_micro_batches"] == len(samples)
            elif budget == 10_000:
                assert got["train_micro_batches"] == 2  # one per optimizer step: steps are global batches
            if budget > 1:
                assert got["train_max_micro_batch_tokens"] <= budget
            assert_same_params(backend.model, fixed.model, initial)  # after each rollout of two steps
            if fixed.critic is not None:
                assert_same_params(backend.critic.module, fixed.critic.module, critic_initial)


def test_one_long_response_never_overflows_the_budget(model_dir, caplog):
    samples = make_samples(0, long_response=60)
    lengths = [len(s.tokens) for s in samples]
    longest = max(lengths)
    assert longest >= 10 * sorted(lengths)[-2] // 2 and lengths.count(longest) == 1
    fixed = TorchBackend(spec(model_dir))
    initial = [p.detach().clone() for p in fixed.model.parameters()]
    expected = fixed.train_rollout(samples, 0)
    assert expected["train_max_micro_batch_tokens"] > longest  # fixed micro-batches put it beside others
    packed = TorchBackend(spec(model_dir, max_tokens=longest))
    with caplog.at_level(logging.WARNING, logger="vime.backends.torch_backend"):
        got = packed.train_rollout(samples, 0)
    assert not caplog.records
    assert got["train_max_micro_batch_tokens"] <= longest
    assert_same_steps(got, expected)
    assert_same_params(packed.model, fixed.model, initial)
    # A budget below the long sample: it trains alone, with one warning naming its length and the flag.
    tight = TorchBackend(spec(model_dir, max_tokens=longest // 2))
    with caplog.at_level(logging.WARNING, logger="vime.backends.torch_backend"):
        tight.train_rollout(samples, 0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "--max-tokens-per-gpu" in warnings[0] and f"{longest} tokens" in warnings[0]
    assert tight._batch_layout(samples).train.count([lengths.index(longest)]) == 1


# ---------------------------------------------------------------------- two data-parallel ranks (gloo)

DP_CASES = [(30, False), (30, True), (10_000, True)]  # (--max-tokens-per-gpu, --balance-data)


def _rank(rank: int, port: int, model_dir: str, work: str) -> None:
    join_group(rank, port)
    from tests.unit.test_dynamic_batching import DP_CASES, RUNS, make_samples, spec

    results = {}
    for case in DP_CASES:
        # Budget 30: three micro-batches in most steps (ranks run two and one; --balance-data assigns them
        # otherwise than round-robin). Budget 10000: one per step, so rank 1 only joins the sums.
        max_tokens, balance = case
        backend = TorchBackend(
            spec(model_dir, max_tokens=max_tokens, forward_tokens=50, balance=balance, **RUNS["kl_loss_entropy"])
        )
        assert backend.dp.size == 2
        metrics = [backend.train_rollout(make_samples(seed, long_response=25), 0) for seed in (0, 1)]
        results[case] = {
            "metrics": metrics,
            "weights": {n: p.detach().clone() for n, p in backend.model.named_parameters()},
        }
    torch.save(results, os.path.join(work, f"rank{rank}.pt"))
    leave_group()


def test_two_ranks_with_token_budgets_take_one_ranks_steps(model_dir, tmp_path):
    run_ranks(_rank, (free_port(), model_dir, str(tmp_path)), 2)
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    single = TorchBackend(spec(model_dir, **RUNS["kl_loss_entropy"]))
    expected = [single.train_rollout(make_samples(seed, long_response=25), 0) for seed in (0, 1)]
    for case in DP_CASES:
        for rank in ranks:
            for got, reference in zip(rank[case]["metrics"], expected):
                assert_same_steps(got, reference)
            for name, param in single.model.named_parameters():
                torch.testing.assert_close(
                    rank[case]["weights"][name], param.detach(), rtol=0, atol=1e-5, msg=f"{case}: {name}"
                )


def test_balanced_ranks_get_similar_token_counts(model_dir):
    """The assignment --balance-data uses, on one step of the long-response rollout: the rank with the long
    sample gets fewer micro-batches than round-robin would give it."""
    backend = TorchBackend(spec(model_dir, max_tokens=30, balance=True))
    samples = make_samples(0, long_response=25)
    layout = backend._batch_layout(samples)
    step = layout.steps[0]
    tokens = [sum(len(samples[i].tokens) for i in mb) for mb in step]
    owners = assign_to_ranks(tokens, 2)
    balanced = [sum(t for t, o in zip(tokens, owners) if o == r) for r in range(2)]
    round_robin = [sum(tokens[r::2]) for r in range(2)]
    assert max(balanced) - min(balanced) <= max(round_robin) - min(round_robin)
    assert max(balanced) - min(balanced) <= max(tokens)


# ---------------------------------------------------------------------- start-up checks
@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize(
    "extra, flag, message",
    [
        (["--use-dynamic-batch-size"], "--max-tokens-per-gpu", "is required with --use-dynamic-batch-size"),
        (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu", "must be >= 1"),
        (
            ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--log-probs-max-tokens-per-gpu", "-1"],
            "--log-probs-max-tokens-per-gpu",
            "must be >= 1",
        ),
        (["--max-tokens-per-gpu", "64"], "--max-tokens-per-gpu", "has no effect without --use-dynamic-batch-size"),
        (["--num-steps-per-rollout", "0"], "--num-steps-per-rollout", "must be >= 1"),
        (
            ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "3"],
            "--num-steps-per-rollout",
            "3 must divide --rollout-batch-size x --n-samples-per-prompt = 8",
        ),
        (
            [
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "2",
                "--num-steps-per-rollout",
                "2",
                "--global-batch-size",
                "8",
            ],
            "--num-steps-per-rollout",
            "disagree with --global-batch-size 8",
        ),
        (["--balance-data", "--use-distributed-optimizer"], "--balance-data", "cannot be combined"),
    ],
)
def test_bad_token_budget_flags_are_refused_naming_the_flag(config_dir, extra, flag, message):
    with pytest.raises(ConfigError) as error:
        parse_train_args(base(config_dir, *extra))
    assert str(error.value).startswith(f"{flag}: ") and message in str(error.value), str(error.value)


def test_token_budget_flags_reach_the_trainer(config_dir):
    from workers.trainer_worker import TrainerWorkerSpec

    s = parse_train_args(
        base(
            config_dir,
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--num-steps-per-rollout",
            "4",
            "--use-dynamic-batch-size",
            "--max-tokens-per-gpu",
            "512",
            "--balance-data",
            "--actor-num-gpus-per-node",
            "2",
        )
    )
    assert s.global_batch_size == 2  # 8 samples / 4 steps; no multiple of micro-batch x replicas needed
    assert (
        parse_train_args(
            base(
                config_dir,
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "2",
                "--num-steps-per-rollout",
                "2",
                "--global-batch-size",
                "4",
            )
        ).global_batch_size
        == 4
    )
    from vime.backends.lr_schedule import lr_schedule_from_settings, optimizer_steps_per_rollout

    assert optimizer_steps_per_rollout(8, 2, 64, dynamic=True) == 4
    lr_schedule_from_settings(s)
    backend = TrainerWorkerSpec.from_settings(s, transport="memory", store=None, threads=1, cpu_affinity=None).backend
    assert backend.use_dynamic_batch_size and backend.max_tokens_per_gpu == 512
    assert backend.log_probs_max_tokens_per_gpu is None and backend.balance_data and backend.global_batch_size == 2


def test_megatron_expert_parallelism_takes_token_budgets_with_a_sample_per_rank(config_dir):
    """Expert-parallel ranks exchange tokens in every forward; with token budgets the backend gives each as many
    micro-batches as the others (vime.backends.micro_batches.split_to_multiple), so the flags are accepted, as
    long as every optimizer step has a sample for each data-parallel rank."""
    from vime.config import check_trainer_parallelism

    def settings(*extra):
        s = parse_train_args(
            base(
                config_dir,
                "--actor-num-gpus-per-node",
                "2",
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "2",
                "--micro-batch-size",
                "1",
                "--use-dynamic-batch-size",
                "--max-tokens-per-gpu",
                "256",
                *extra,
            )
        )
        s.train.train_backend = "megatron"  # Megatron needs CUDA at parse time: its settings are made here
        return s

    s = settings("--balance-data")
    s.megatron.expert_model_parallel_size = 2
    check_trainer_parallelism(s)
    s = settings("--n-samples-per-prompt", "1", "--global-batch-size", "1", "--num-steps-per-rollout", "4")
    check_trainer_parallelism(s)  # data parallelism alone: a rank without a micro-batch still joins the sums
    s.megatron.expert_model_parallel_size = 2
    with pytest.raises(ConfigError, match="^--global-batch-size: 1 is fewer samples than the 2 data-parallel ranks"):
        check_trainer_parallelism(s)
    # Experts split over fewer ranks than a tensor-parallel group (the reference scripts' --expert-tensor-parallel-size
    # 1 under --tensor-model-parallel-size 2): no token leaves the group, whose ranks share their micro-batches.
    s.megatron.expert_model_parallel_size, s.megatron.tensor_model_parallel_size = 1, 2
    s.megatron.expert_tensor_parallel_size = 1
    check_trainer_parallelism(s)


# ---------------------------------------------------------------------- the Megatron backend (CPU shim)
def test_megatron_backend_with_token_budgets_trains_as_fixed_micro_batches(tmp_path):
    pytest.importorskip("megatron.core")
    from tests import megatron_shim

    megatron_shim.install()
    from tests.unit.test_megatron_backend import assert_same_weights, megatron_spec
    from vime.backends.megatron_backend import MegatronBackend

    model_dir = megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path / "tiny"))
    algorithm = RUNS["kl_loss_entropy"]
    fixed = TorchBackend(spec(model_dir, **algorithm))
    megatron = MegatronBackend(spec(model_dir, max_tokens=20, forward_tokens=40, **algorithm), megatron_spec(model_dir))
    for rollout in range(2):
        samples = make_samples(rollout, long_response=30)
        expected = fixed.train_rollout(samples, 0)
        got = megatron.train_rollout(samples, 0)
        assert_same_steps(got, expected)
        assert got["train_micro_batches"] > expected["train_micro_batches"]
    assert_same_weights(megatron, fixed.model)
