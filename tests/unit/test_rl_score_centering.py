"""Score centering: the correction against loops over the paper's definitions, and the property it exists for
(its gradient is the sampler-expected weighted score E_{y~q}[w(y) grad log p(y)]); what the rollout asks the
engines for and records (top-k heads, top-p supports) across continuations and tool output; the engine flags
set at start-up; and the trainer's top-p replay. tests/e2e/test_score_centering_engine.py runs the same path
through a real engine."""

import argparse
import json
import math
import random

import numpy as np
import pytest
import torch

from vime.config import ConfigError, parse_train_args
from vime.rl.score_centering import sampled_importance_weight, support_correction, topk_correction, weighting
from vime.rollout.generate import (
    GenerateError,
    SamplingParams,
    append_observation,
    sampler_rows,
    score_centering_capture,
    score_centering_request,
)
from vime.sample import Sample, SamplerRows

F64 = torch.float64
LOGITS = [0.3, 1.2, -0.5, 0.8, -1.0, 0.1]  # trainer, vocabulary of 6
HEAD = [1, 3, 0]  # the sampler's top-3 ids
SAMPLER_HEAD = [0.40, 0.20, 0.15]  # its probabilities there (full-vocabulary normalised)


def softmax(z):
    m = sum(math.exp(v) for v in z)
    return [math.exp(v) / m for v in z]


def weight(ratio, mode, low, high):
    if mode == "none":
        return 1.0
    if mode == "tis":
        return min(max(ratio, low), high)
    return ratio if low <= ratio <= high else 0.0


def ref_topk(p_head, q_head, mode, low, high, eps=1e-6):
    p_mass, q_mass = sum(p_head), sum(q_head)
    rho = max(1 - q_mass, eps) / max(1 - p_mass, eps)
    alpha = rho * weight(1 / rho, mode, low, high)
    correction = sum((q * weight(p / q, mode, low, high) - alpha * p) * math.log(p) for p, q in zip(p_head, q_head))
    return correction, q_mass, p_mass


MODES = [("none", None, None), ("tis", 0.5, 1.5), ("mis", 0.8, 1.2)]


@pytest.mark.parametrize("mode, low, high", MODES)
def test_topk_correction_matches_the_formula(mode, low, high):
    p = softmax(LOGITS)
    train_head = torch.tensor([[math.log(p[i]) for i in HEAD]], dtype=F64)
    sampler_head = torch.tensor([[math.log(q) for q in SAMPLER_HEAD]], dtype=F64)
    correction, q_mass, p_mass = topk_correction(train_head, sampler_head, mode=mode, low=low, high=high)
    expected = ref_topk([p[i] for i in HEAD], SAMPLER_HEAD, mode, low, high)
    assert [correction.item(), q_mass.item(), p_mass.item()] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode, low, high", MODES)
def test_topk_gradient_is_the_expected_score_when_the_tail_follows_the_trainer(mode, low, high):
    # Build a sampler whose tail is exactly rho * p: then the head-plus-modelled-tail term is exact.
    p = softmax(LOGITS)
    p_head_mass, q_head_mass = sum(p[i] for i in HEAD), sum(SAMPLER_HEAD)
    rho = (1 - q_head_mass) / (1 - p_head_mass)
    q = [rho * pi for pi in p]
    for i, qi in zip(HEAD, SAMPLER_HEAD):
        q[i] = qi
    assert sum(q) == pytest.approx(1.0)
    # E_{y~q}[w(p_y/q_y) d log p_y / d z] with d log p_y / d z_v = [v == y] - p_v
    expected = [
        sum(q[y] * weight(p[y] / q[y], mode, low, high) * ((v == y) - p[v]) for y in range(6)) for v in range(6)
    ]
    z = torch.tensor(LOGITS, dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[HEAD].unsqueeze(0)
    correction, _, _ = topk_correction(
        train_head, torch.tensor([[math.log(v) for v in SAMPLER_HEAD]], dtype=F64), mode=mode, low=low, high=high
    )
    correction.sum().backward()
    assert z.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_matching_distributions_need_no_centering():
    p = softmax(LOGITS)
    z = torch.tensor([LOGITS], dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[:, HEAD]
    correction, q_mass, p_mass = topk_correction(train_head, train_head.detach(), mode="tis", low=0.5, high=2.0)
    correction.sum().backward()
    assert abs(correction.item()) < 1e-12 and z.grad.abs().max() < 1e-12
    assert q_mass.item() == pytest.approx(p_mass.item()) == pytest.approx(sum(p[i] for i in HEAD))


def test_a_head_holding_all_the_mass_stays_finite():
    z = torch.tensor([[5.0, -50.0, -50.0]], dtype=F64, requires_grad=True)
    train_head = torch.log_softmax(z, -1)[:, [0]]
    correction, _, _ = topk_correction(train_head, torch.zeros((1, 1), dtype=F64))  # sampler head mass 1
    correction.sum().backward()
    assert torch.isfinite(correction).all() and torch.isfinite(z.grad).all()


def ref_support(train_logits_rows, sampler_rows, mode, low, high):
    out = []
    for logits, q in zip(train_logits_rows, sampler_rows):
        p = softmax(logits)
        w1 = weight(1.0, mode, low, high)
        out.append(sum((qi * weight(pi / qi, mode, low, high) - w1 * pi) * math.log(pi) for pi, qi in zip(p, q)))
    return out


@pytest.mark.parametrize("mode, low, high", MODES)
def test_support_correction_on_ragged_top_p_supports(mode, low, high):
    logits_rows = [[0.5, 0.1, -0.3], [1.0], [0.2, 0.9]]  # supports of 3, 1 and 2 tokens
    sampler_rows = [[0.5, 0.3, 0.2], [1.0], [0.45, 0.55]]
    flat_logits = [torch.tensor(r, dtype=F64, requires_grad=True) for r in logits_rows]
    train = torch.cat([torch.log_softmax(r, -1) for r in flat_logits])
    sampler = torch.tensor([math.log(v) for r in sampler_rows for v in r], dtype=F64)
    correction, q_mass, p_mass = support_correction(
        train, sampler, torch.tensor([0, 3, 4, 6]), mode=mode, low=low, high=high
    )
    assert correction.tolist() == pytest.approx(ref_support(logits_rows, sampler_rows, mode, low, high), abs=1e-12)
    assert q_mass.tolist() == pytest.approx([1.0, 1.0, 1.0]) and p_mass.tolist() == pytest.approx([1.0, 1.0, 1.0])
    correction.sum().backward()
    for logits, q, z in zip(logits_rows, sampler_rows, flat_logits):
        p = softmax(logits)
        expected = [
            sum(q[y] * weight(p[y] / q[y], mode, low, high) * ((v == y) - p[v]) for y in range(len(p)))
            for v in range(len(p))
        ]
        assert z.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_weighting_rules():
    assert weighting(False, None, 0.0, 2.0) == {"mode": "none"}
    assert weighting(True, None, 0.1, 2.0) == {"mode": "tis", "low": 0.1, "high": 2.0}
    assert weighting(True, "vime.rl.tis.icepop_function", 0.5, 2.0)["mode"] == "mis"
    with pytest.raises(ValueError, match="built-in"):
        weighting(True, "my.module.weigh", 0.5, 2.0)
    w = sampled_importance_weight(
        torch.tensor([0.0, 0.0]), torch.tensor([math.log(4.0), math.log(0.9)]), mode="tis", low=0.5, high=2.0
    )
    assert w.tolist() == pytest.approx([0.5, 1 / 0.9])


# ---------------------------------------------------------------- the rollout side: requests and captures
TOP_K = score_centering_capture(3, 1.0)
SUPPORT = score_centering_capture(3, 0.9)


def entry(token, candidates):
    """One ``logprobs.content`` entry as vLLM's generate endpoint sends it: the sampled token first."""
    return {
        "token_id": token,
        "logprob": dict(candidates)[token],
        "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in candidates],
    }


def sc_args(**overrides):
    values = {
        "use_score_centering": True,
        "score_centering_top_k": 3,
        "rollout_temperature": 0.7,
        "rollout_top_p": 1.0,
        **overrides,
    }
    return argparse.Namespace(**values)


def test_requests_ask_for_k_plus_one_log_probs_or_the_whole_vocabulary():
    assert SamplingParams(max_new_tokens=4).for_vllm(4)["logprobs"] == 0
    assert SamplingParams(max_new_tokens=4, score_centering_top_k=3).for_vllm(4)["logprobs"] == 4
    assert SamplingParams(max_new_tokens=4, top_p=0.9, score_centering_top_k=3).for_vllm(4)["logprobs"] == -1
    args = sc_args(rollout_top_p=0.9)
    request, capture = score_centering_request(args, {"max_tokens": 4, "temperature": 0.7, "logprobs": 0})
    assert request == {"max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "logprobs": -1} and capture.support
    plain = {"max_tokens": 4}
    assert score_centering_request(sc_args(use_score_centering=False), plain) == (plain, None)


@pytest.mark.parametrize(
    "params, named",
    [
        ({"temperature": 1.0}, "--rollout-temperature"),
        ({"top_p": 0.5}, "--rollout-top-p"),
        ({"top_k": 20}, "top_k"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"min_p": 0.05}, "min_p"),
    ],
)
def test_requests_that_sample_otherwise_are_refused(params, named):
    with pytest.raises(GenerateError, match=named):
        score_centering_request(sc_args(), params)


def test_top_k_heads_keep_the_k_most_probable_of_the_answer():
    # vLLM lists the sampled token first; outside the top k + 1 it displaces the (k+1)-th from the list.
    content = [
        entry(7, [(7, -4.0), (2, -0.5), (5, -1.0), (1, -1.5), (9, -2.0)]),
        entry(5, [(5, -1.0), (2, -0.5), (1, -1.5), (9, -2.0)]),
    ]  # sampled token inside the head
    rows = sampler_rows(content, TOP_K)
    assert not rows.is_support and rows.ids.dtype == np.int32 and rows.log_probs.dtype == np.float32
    assert rows.ids.tolist() == [[2, 5, 1], [2, 5, 1]]
    assert rows.log_probs.tolist() == [[-0.5, -1.0, -1.5]] * 2
    with pytest.raises(GenerateError, match="--vllm-max-logprobs"):
        sampler_rows([entry(5, [(5, -1.0), (2, -0.5)])], TOP_K)


def test_top_p_supports_keep_the_tokens_with_finite_log_probs():
    floor = -9999.0  # vLLM's JSON stand-in for -inf
    content = [
        entry(3, [(3, -0.2), (0, -1.7), (1, floor), (2, floor)]),
        entry(1, [(1, 0.0), (0, floor), (2, floor), (3, floor)]),
    ]
    rows = sampler_rows(content, SUPPORT)
    assert rows.is_support and rows.offsets.tolist() == [0, 2, 3]
    assert rows.ids.tolist() == [3, 0, 1] and rows.log_probs.tolist() == pytest.approx([-0.2, -1.7, 0.0])
    with pytest.raises(GenerateError, match="--vllm-logprobs-mode"):
        sampler_rows([entry(2, [(2, floor), (3, 0.0)])], SUPPORT)


def topk(rows):
    ids = np.array([[t, t + 1] for t in rows], np.int32)
    return SamplerRows(ids, -np.ones(ids.shape, np.float32))


def test_heads_follow_continuations_and_tool_output():
    sample = Sample(tokens=[1, 2])
    sample.append_response_tokens([3, 4], [-0.1, -0.2], [0, 0], sampler=topk([3, 4]))
    # What a partial rollout resumes from after the queue: tensors instead of arrays.
    sample.rollout_topk_token_ids = torch.as_tensor(sample.rollout_topk_token_ids)
    sample.rollout_topk_log_probs = torch.as_tensor(sample.rollout_topk_log_probs)
    sample.append_response_tokens([5], [-0.3], [1], sampler=topk([5]))
    append_observation(sample, [8, 9])
    sample.append_response_tokens([6], [-0.4], [1], sampler=topk([6]))
    assert sample.response_length == 6 and sample.loss_mask == [1, 1, 1, 0, 0, 1]
    assert sample.rollout_topk_token_ids.tolist() == [[3, 4], [4, 5], [5, 6], [0, 0], [0, 0], [6, 7]]
    assert np.isneginf(sample.rollout_topk_log_probs[3:5]).all() and (sample.rollout_topk_log_probs[:3] == -1).all()
    with pytest.raises(ValueError, match="trained tokens appended without"):
        sample.append_response_tokens([7], [-0.5], [1])
    with pytest.raises(ValueError, match="differ in kind or size"):
        sample.append_response_tokens([7], [-0.5], [1], sampler=SamplerRows(np.zeros((1, 3)), np.zeros((1, 3))))
    assert sample.response_length == 6  # a refused append changes nothing


def test_supports_follow_continuations_and_tool_output():
    sample = Sample(tokens=[1])
    append_observation(sample, [4])  # a first observation has no sampler rows to fill yet
    sample.append_response_tokens(
        [2, 3], [-0.1, 0.0], [0, 0], sampler=SamplerRows([2, 5, 3], [-0.1, -2.4, 0.0], [0, 2, 3])
    )
    append_observation(sample, [8])
    sample.append_response_tokens([6], [-0.7], [1], sampler=SamplerRows([6, 1], [-0.7, -0.7], [0, 2]))
    assert sample.rollout_topp_offsets.tolist() == [0, 0, 2, 3, 3, 5]
    assert sample.rollout_topp_ids.tolist() == [2, 5, 3, 6, 1]
    assert sample.rollout_topp_log_probs.tolist() == pytest.approx([-0.1, -2.4, 0.0, -0.7, -0.7])
    with pytest.raises(ValueError, match="offsets"):
        sample.append_response_tokens([6], [-0.7], [1], sampler=SamplerRows([6, 1], [-0.7, -0.7], [0, 1]))
    trained = Sample(tokens=[1])
    trained.append_response_tokens([2], [-0.1], [0])
    with pytest.raises(ValueError, match="earlier trained tokens"):
        trained.append_response_tokens([3], [0.0], [0], sampler=SamplerRows([3], [0.0], [0, 1]))


# ---------------------------------------------------------------- start-up: the engines' flags
@pytest.fixture
def vocab_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12}))
    return str(tmp_path)


def launch(vocab_dir, *extra):
    return parse_train_args(
        [
            "--hf-checkpoint",
            vocab_dir,
            "--prompt-data",
            "data.jsonl",
            "--rm-type",
            "exact_match",
            "--run-dir",
            "/tmp/vime-test-run",
            "--use-score-centering",
            "--score-centering-top-k",
            "4",
            *extra,
        ]
    )


def test_engines_get_processed_log_probs_and_enough_of_them(vocab_dir):
    engine = launch(vocab_dir).vllm.vllm_args
    assert engine["logprobs-mode"] == "processed_logprobs" and engine["max-logprobs"] == "5"
    assert launch(vocab_dir, "--rollout-top-p", "0.9").vllm.vllm_args["max-logprobs"] == "-1"
    given = launch(vocab_dir, "--vllm-logprobs-mode", "processed_logprobs", "--vllm-max-logprobs", "50").vllm.vllm_args
    assert given["logprobs-mode"] == "processed_logprobs" and given["max-logprobs"] == "50"
    whole = launch(vocab_dir, "--rollout-top-p", "0.9", "--vllm-max-logprobs", "12").vllm.vllm_args
    assert whole["max-logprobs"] == "12"
    assert (
        "logprobs-mode"
        not in parse_train_args(
            ["--hf-checkpoint", vocab_dir, "--prompt-data", "data.jsonl", "--rm-type", "exact_match"]
        ).vllm.vllm_args
    )


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--vllm-logprobs-mode", "raw_logprobs"], "--vllm-logprobs-mode"),
        (["--vllm-max-logprobs", "4"], "--vllm-max-logprobs"),
        (["--rollout-top-p", "0.9", "--vllm-max-logprobs", "20"], None),  # covers the vocabulary of 12
        (["--rollout-top-p", "0.9", "--vllm-max-logprobs", "11"], "--vllm-max-logprobs"),
        (["--score-centering-top-k", "12"], "--score-centering-top-k"),  # k + 1 log-probs exceed 12
    ],
)
def test_engine_flags_that_defeat_score_centering_name_the_flag(vocab_dir, extra, flag):
    if flag is None:
        launch(vocab_dir, *extra)
        return
    with pytest.raises(ConfigError) as error:
        launch(vocab_dir, *extra)
    assert str(error.value).startswith(flag + ":"), str(error.value)


# ---------------------------------------------------------------- the trainer: top-p replay
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vime.tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(
        str(tmp_path_factory.mktemp("sc_tiny_model")),
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def full_log_probs(model, sample):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sample.tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1)[sample.prompt_length - 1 :]


def supported_samples(model, *, seed=0, shift=0.0):
    """Two groups of four samples whose sampler recorded random supports (each holding its sampled
    token) with the trainer's own probabilities renormalised on them, moved by ``shift`` when given;
    one tool token per sample, with an empty support."""
    rng = random.Random(seed)
    samples = []
    for g in range(2):
        prompt = [rng.randint(1, 10) for _ in range(3)] + [11]
        for i in range(4):
            response = [rng.randint(1, 11) for _ in range(rng.randint(3, 5))]
            sample = Sample(
                group_index=g,
                index=i,
                tokens=prompt + response,
                response_length=len(response),
                reward=float(i % 2),
                status=Sample.Status.COMPLETED,
                weight_versions=[0] * len(response),
            )
            sample.loss_mask = [1] * len(response)
            sample.loss_mask[1] = 0
            log_probs = full_log_probs(model, sample)
            ids, values, offsets, sampled = [], [], [0], []
            for t, token in enumerate(response):
                support = [] if t == 1 else sorted({token, *rng.sample(range(12), rng.randint(0, 6))})
                noise = torch.randn(len(support), generator=torch.Generator().manual_seed(t))
                row = log_probs[t, support] + shift * noise
                row = row - torch.logsumexp(row, 0) if support else row
                ids += support
                values += row.tolist()
                offsets.append(len(ids))
                sampled.append(row[support.index(token)].item() if support else 0.0)
            sample.rollout_topp_ids, sample.rollout_topp_log_probs = np.array(ids), np.array(values, np.float32)
            sample.rollout_topp_offsets = np.array(offsets)
            sample.rollout_log_probs = sampled
            samples.append(sample)
    return samples


def sc_backend(path, **algorithm):
    from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
    from vime.config.algorithm import AlgorithmConfig

    algo = AlgorithmConfig(use_score_centering=True, calculate_per_token_loss=True, **algorithm)
    algo.validate()
    return TorchBackend(
        TorchTrainerSpec(
            hf_checkpoint=path,
            lr=1e-3,
            weight_decay=0.0,
            adam_betas=(0.9, 0.999),
            adam_eps=1e-8,
            clip_grad=1.0,
            micro_batch_size=8,
            global_batch_size=8,
            n_samples_per_prompt=4,
            rollout_temperature=1.0,
            algorithm=algo,
            seed=0,
            threads=1,
        )
    )


def test_top_p_replay_normalises_the_trainer_on_exactly_the_recorded_support(tiny):
    from vime.backends.torch_backend import pack

    path, model = tiny
    samples = supported_samples(model)
    trainer = sc_backend(path)
    batch = pack(samples, trainer.pad_id, with_heads=True)
    with torch.no_grad():
        replayed = batch.rows(trainer._log_probs(batch))
    for sample, row in zip(samples, replayed):
        log_probs, offsets = full_log_probs(model, sample), sample.rollout_topp_offsets
        for t, token in enumerate(sample.response_tokens):
            support = sample.rollout_topp_ids[offsets[t] : offsets[t + 1]]
            expected = log_probs[t, token] - (torch.logsumexp(log_probs[t, support], 0) if len(support) else 0)
            assert row[t].item() == pytest.approx(expected.item(), abs=1e-5)  # the tool token stays as it was
    metrics = sc_backend(path).train_rollout(samples, 0)
    assert abs(metrics["sc_correction"]) < 1e-6 and metrics["onpolicy_logprob_abs_diff"] < 1e-5
    assert metrics["sc_sampler_head_mass"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sc_train_head_mass"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("mode", [{}, {"use_tis": True, "tis_clip_low": 0.5, "tis_clip": 1.5}])
def test_top_p_correction_is_the_support_formula(tiny, mode):
    path, model = tiny
    samples = supported_samples(model, shift=0.5)
    metrics = sc_backend(path, **mode).train_rollout(samples, 0)
    w = weighting(bool(mode), None, mode.get("tis_clip_low", 0.0), mode.get("tis_clip", 2.0))
    corrections = []
    for sample in samples:
        log_probs, offsets = full_log_probs(model, sample), sample.rollout_topp_offsets
        for t in range(sample.response_length):
            if sample.loss_mask[t]:
                support = sample.rollout_topp_ids[offsets[t] : offsets[t + 1]]
                train = torch.log_softmax(log_probs[t, support], 0)
                sampler = torch.as_tensor(sample.rollout_topp_log_probs[offsets[t] : offsets[t + 1]])
                corrections.append(support_correction(train, sampler, torch.tensor([0, len(support)]), **w)[0])
    assert abs(metrics["sc_correction"]) > 1e-3
    assert metrics["sc_correction"] == pytest.approx(torch.cat(corrections).mean().item(), abs=1e-5)


def test_a_trained_token_outside_its_support_is_refused(tiny):
    path, model = tiny
    samples = supported_samples(model)
    sample = samples[3]
    first = sample.rollout_topp_offsets[1]
    sample.rollout_topp_ids[:first] = [v for v in range(12) if v != sample.response_tokens[0]][:first]
    with pytest.raises(ValueError, match="outside its recorded top-p support"):
        sc_backend(path).train_rollout(samples, 0)


def test_a_response_started_over_drops_its_old_rows():
    # examples/multi_turn_tool/tool_generate.py restarts a continued sample by clearing its response only.
    sample = Sample(tokens=[1])
    sample.append_response_tokens([2, 3], [-0.1, -0.2], [0, 0], sampler=topk([2, 3]))
    del sample.tokens[1:]
    sample.response_length, sample.weight_versions, sample.rollout_log_probs, sample.loss_mask = 0, [], None, None
    sample.append_response_tokens([4], [-0.3], [1], sampler=topk([4]))
    assert sample.rollout_topk_token_ids.tolist() == [[4, 5]]
    sample.response_length = 2  # rows and response disagree otherwise: refused
    with pytest.raises(ValueError, match="sampler rows for 1 tokens"):
        sample.append_response_tokens([5], [-0.3], [1], sampler=topk([5]))
