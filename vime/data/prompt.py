"""Turn a prompt record into token ids."""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    pass


def render_prompt(tokenizer, prompt: str | list[dict[str, Any]], *, apply_chat_template: bool) -> list[int]:
    if apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("--apply-chat-template: the tokenizer of --hf-checkpoint has no chat template")
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(rendered, "keys"):  # newer transformers return a BatchEncoding
            rendered = rendered["input_ids"]
        return list(rendered)
    if not isinstance(prompt, str):
        raise PromptError("a list of chat messages needs --apply-chat-template")
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
