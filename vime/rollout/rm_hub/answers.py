"""Finding the answer inside a model's response: the last ``\\boxed{...}``, the text after the reasoning.

The rules of the reference framework's reward hub: the *last* boxed expression is the answer (a model
that boxes several candidates is judged on its final one), braces nest (``\\boxed{\\frac{1}{2}}``), and
``\\fbox{...}`` counts as a box too.
"""

from __future__ import annotations

BOX_COMMANDS = ("\\boxed", "\\fbox")
THINK_END = "</think>"


def last_boxed_answer(text: str | None) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``; None when there is none or
    its braces never close (a response cut off by the length limit inside its box has no answer)."""
    if not text:
        return None
    start = max(text.rfind(command) for command in BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in BOX_COMMANDS if text.startswith(c, start))
    position = start + len(command)
    while position < len(text) and text[position] == " ":
        position += 1
    if position >= len(text) or text[position] != "{":
        # '\boxed 5': the argument is the next token (TeX's own rule for an unbraced argument).
        rest = text[position:].split()
        return rest[0].rstrip("$.") if rest and position > start + len(command) else None
    depth = 0
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1 : index]
    return None


def answer_of_label(label) -> str:
    """A label as the answer it names: a boxed label (a whole worked solution) gives its boxed content."""
    text = "" if label is None else str(label)
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed_answer(text) or ""
    return text


def after_thinking(text: str | None) -> str:
    """The part of a response after its last ``</think>`` (the whole response when there is none)."""
    if not text:
        return ""
    return text.rsplit(THINK_END, 1)[-1]
