"""The offline tiny-model tool: tokenizer round trip, untied weights, loadable models of both archs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vime.tools.make_tiny_model import main, make_tiny_model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    path = make_tiny_model(str(out), arch=request.param)
    return request.param, path


def test_returns_absolute_path_with_files(tiny):
    _, path = tiny
    assert os.path.isabs(path)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(path, name)), name


def test_tokenizer_round_trip(tiny):
    _, path = tiny
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("371=", add_special_tokens=False).input_ids
    # "<|endoftext|>" is 0, then "0".."9" are 1..10 and "=" is 11.
    assert ids == [4, 8, 2, 11]
    assert tok.decode([5, 9, 3]) == "482"
    assert tok.decode([5, 9, 3, 0], skip_special_tokens=True) == "482"
    assert tok.decode([5, 9, 3, 0]) == "482<|endoftext|>"
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert len(tok) == 12


def test_config_untied_and_eos(tiny):
    arch, path = tiny
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == arch
    assert cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 12
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    assert cfg["eos_token_id"] == 0 and cfg["pad_token_id"] == 0
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 0


def test_model_loads_and_gives_finite_logits(tiny):
    arch, path = tiny
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    # Untied: lm_head has its own storage (vLLM reloads do not refresh a tied head).
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[4, 8, 2, 11, 5]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, 12)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0


def test_deterministic_and_idempotent(tmp_path):
    a = make_tiny_model(str(tmp_path / "a"), seed=3, hidden_size=64, num_heads=2, num_kv_heads=1)
    # Write something else first, then the same arguments again: the rerun must overwrite cleanly.
    b_dir = str(tmp_path / "b")
    make_tiny_model(b_dir, arch="llama", seed=9)
    b = make_tiny_model(b_dir, seed=3, hidden_size=64, num_heads=2, num_kv_heads=1)
    ma = AutoModelForCausalLM.from_pretrained(a)
    mb = AutoModelForCausalLM.from_pretrained(b)
    assert mb.config.model_type == "qwen2" and mb.config.hidden_size == 64
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    other = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(str(tmp_path / "c"), seed=4, hidden_size=64, num_heads=2, num_kv_heads=1)
    )
    assert not torch.equal(other.lm_head.weight, ma.lm_head.weight)


def test_cli_and_custom_chars(tmp_path):
    out = tmp_path / "cli"
    assert (
        main(
            [
                str(out),
                "--arch",
                "llama",
                "--chars",
                "0123456789=+",
                "--hidden-size",
                "64",
                "--num-heads",
                "2",
                "--num-kv-heads",
                "1",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("1+2=", add_special_tokens=False).input_ids == [2, 12, 3, 11]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "llama" and model.config.vocab_size == 13


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "gpt2"},
        {"hidden_size": 64},  # head_dim 16: not served by vLLM's CPU attention
        {"num_kv_heads": 3},
        {"chars": "0 1"},  # a space would not survive the Qwen2 byte-level tokenizer
        {"chars": "00"},
    ],
)
def test_rejects_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        make_tiny_model(str(tmp_path / "x"), **kwargs)
