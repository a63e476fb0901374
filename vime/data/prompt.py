"""Turn a prompt record into token ids, and a chat conversation into SFT tokens + loss mask."""

from __future__ import annotations

from typing import Any

from vime.errors import UserError


class PromptError(UserError, ValueError):
    pass


def chat_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a chat template sees: vime's own keys (``step_loss_mask``) removed."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{k: v for k, v in message.items() if k != "step_loss_mask"} for message in prompt]


def _apply_template(
    tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool, kwargs: dict | None = None
) -> list[int]:
    """``kwargs``: --apply-chat-template-kwargs, extra keyword arguments of the template (e.g. enable_thinking)."""
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, **(kwargs or {})
    )
    if hasattr(rendered, "keys"):  # newer transformers return a BatchEncoding
        rendered = rendered["input_ids"]
    return list(rendered)


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("--apply-chat-template: the tokenizer of --hf-checkpoint has no chat template")


def render_prompt(
    tokenizer,
    prompt: str | list[dict[str, Any]],
    *,
    apply_chat_template: bool,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """The prompt's token ids; ``chat_template_kwargs`` (--apply-chat-template-kwargs) go to the template."""
    if apply_chat_template:
        _require_template(tokenizer)
        return _apply_template(
            tokenizer, chat_messages(prompt), add_generation_prompt=True, kwargs=chat_template_kwargs
        )
    if not isinstance(prompt, str):
        raise PromptError("a list of chat messages needs --apply-chat-template")
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def sft_tokens(
    tokenizer, messages: list[dict[str, Any]], chat_template_kwargs: dict | None = None
) -> tuple[list[int], int, list[int]]:
    """(tokens, response_length, loss_mask) of a whole conversation, for SFT.

    The response starts at the first assistant turn. Each assistant turn's own tokens get loss mask
    1, unless the message says ``"step_loss_mask": 0``; everything else (user and tool turns, the
    template's assistant header) gets 0. Turns are found by rendering growing prefixes of the
    conversation, which needs a template whose rendering of a prefix is a prefix of the whole.
    """
    _require_template(tokenizer)
    if not isinstance(messages, list) or not messages:
        raise PromptError("SFT needs a list of chat messages")
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise PromptError("SFT needs at least one assistant message to learn from")
    clean = chat_messages(messages)
    tokens = _apply_template(tokenizer, clean, add_generation_prompt=False, kwargs=chat_template_kwargs)
    prompt_length = len(
        _apply_template(tokenizer, clean[:first], add_generation_prompt=True, kwargs=chat_template_kwargs)
    )
    mask = [0] * len(tokens)
    for turn in range(first, len(messages)):
        if messages[turn].get("role") != "assistant":
            continue
        head = _apply_template(tokenizer, clean[:turn], add_generation_prompt=True, kwargs=chat_template_kwargs)
        through = _apply_template(
            tokenizer, clean[: turn + 1], add_generation_prompt=False, kwargs=chat_template_kwargs
        )
        if tokens[: len(head)] != head or tokens[: len(through)] != through:
            raise PromptError(
                "the chat template does not render a conversation's prefix as a prefix of the whole; "
                "cannot locate the assistant turns"
            )
        start, end = len(head), len(through)
        step_loss_mask = messages[turn].get("step_loss_mask", 1)
        if step_loss_mask is None or step_loss_mask:
            mask[start:end] = [1] * (end - start)
    return tokens, len(tokens) - prompt_length, mask[prompt_length:]
