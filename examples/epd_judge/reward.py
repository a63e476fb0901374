"""Reward of the EPD-judge example: the digit-shift score, plus a word from a frozen multimodal judge
served encoder-disaggregated (EPD) by vime (``--vllm-config vllm_config.yaml``, model ``judge``).

For every scored sample:

1. a small PNG is drawn from the response (one grey bar per response character, PIL);
2. ``prime_encoder(args, messages, model_name="judge")`` sends the image to the judge's encoder
   engine (``ec_producer``), which writes its embeddings to the shared encoder cache;
3. the same chat request (image + question) goes to the judge's router
   (``get_model_url(args, "judge", "/v1/chat/completions")``), whose language-only engine
   (``ec_consumer``) loads the embeddings from that cache instead of running the vision tower.

The judge is a random tiny BLIP-2, so its answer means nothing: it is kept in
``sample.metadata["judge_answer"]`` (or the failure in ``sample.metadata["judge_error"]``) and is
weighted by ``JUDGE_WEIGHT = 0``: the reward is the digit-shift score, so training is unchanged.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import logging
import os
import time

import aiohttp

from vime.rollout.vllm_rollout import get_model_url, prime_encoder

_DIGIT_SHIFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "digit_shift", "reward.py")
_spec = importlib.util.spec_from_file_location("digit_shift_reward", _DIGIT_SHIFT)
digit_shift = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digit_shift)
score = digit_shift.score

JUDGE = "judge"  # the model's name in vllm_config.yaml
JUDGE_WEIGHT = 0.0  # the judge is random: its answer is recorded, not scored
JUDGE_TIMEOUT = 120.0  # seconds, for the priming and for the judge's answer each
QUESTION = "Is it right?"

log = logging.getLogger("epd_judge")


def response_image(text: str, size: int = 32) -> str:
    """A ``size`` x ``size`` grey PNG with one bar per character of ``text`` (its height from the
    character's code), as a ``data:`` URL: equal responses give equal images (and one cache entry)."""
    from PIL import Image, ImageDraw

    image = Image.new("L", (size, size), color=0)
    draw = ImageDraw.Draw(image)
    chars = (text or "")[: size // 4]
    for i, ch in enumerate(chars):
        height = 4 + (ord(ch) * 7) % (size - 4)
        draw.rectangle([i * 4, size - height, i * 4 + 2, size - 1], fill=255)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def judge_messages(text: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": response_image(text)}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]


async def ask_judge(args, text: str, *, timeout: float = JUDGE_TIMEOUT) -> dict:
    """Prime the judge's encoder with the image of ``text``, then ask its router; returns
    {"answer", "finish_reason", "tokens", "primed", "seconds"}. Raises on any failure (EngineError from the priming,
    RuntimeError for a bad answer, asyncio.TimeoutError)."""
    started = time.monotonic()
    messages = judge_messages(text)
    primed = await prime_encoder(args, messages, model_name=JUDGE, timeout=timeout)
    # The served model name is the checkpoint path (vLLM's default), as prime_encoder sends it.
    model_path = args.vllm_model_encoder_endpoints[JUDGE][0]
    body = {"model": model_path, "messages": messages, "max_tokens": 4, "temperature": 0}
    url = get_model_url(args, JUDGE, "/v1/chat/completions")
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            if reply.status != 200:
                raise RuntimeError(f"POST {url} answered {reply.status}: {(await reply.text())[:300]}")
            output = await reply.json()
    choice = output["choices"][0]
    return {
        "answer": choice["message"].get("content") or "",
        "finish_reason": choice.get("finish_reason"),
        "tokens": (output.get("usage") or {}).get("completion_tokens", 0),
        "primed": primed,
        "seconds": round(time.monotonic() - started, 3),
    }


async def reward(args, sample) -> float:
    task = score(sample.response, str(sample.label))
    try:
        verdict = await ask_judge(args, sample.response or "")
    except Exception as error:  # noqa: BLE001 - the judge is decoration: a failure is recorded, the task score stands
        sample.metadata["judge_error"] = repr(error)[:300]
        log.warning("judge failed: %r", error)
        return task
    for key in ("answer", "finish_reason", "tokens", "primed", "seconds"):
        sample.metadata[f"judge_{key}"] = verdict[key]
    # A random judge often answers special tokens only (empty text): that it answered is what counts.
    return task + JUDGE_WEIGHT * float(verdict["tokens"] > 0)
