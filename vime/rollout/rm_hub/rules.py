"""The built-in rule-based rewards of ``--rm-type`` (and of a sample's ``metadata["rm_type"]``).

A rule is two steps: find the answer in the response (its own way: the last ``\\boxed{}``, the text after
``</think>``, an ``Answer:`` line, ...), then grade that answer against the sample's label. The ``boxed_``
prefix (``boxed_math``, ``boxed_gpqa``, ...) swaps the first step for "the last ``\\boxed{}`` of the whole
response": a response without one has no answer. Semantics follow the reference framework's reward hub
(slime / vllm-project's vime ``rollout/rm_hub``); where vime differs it says so (docs/rewards.md).
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from vime.config.rewards import BOXED_PREFIX
from vime.rollout.rm_hub.answers import after_thinking, answer_of_label, last_boxed_answer
from vime.rollout.rm_hub.math_equivalence import math_answers_match


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    find_answer: Callable[[str], str | None]  # the answer in a response; None: the response gives none
    grade: Callable[[str | None, Any, dict], float | dict]  # (answer, label, metadata) -> reward
    dict_reward_key: str | None = None  # which key of the rule's dict result is the reward (unless --reward-key)
    symbolic: bool = False  # compares with sympy: graded in the reward process, off the event loop


# ---------------------------------------------------------------------- text rewards
def _spaces_lowered(text: Any) -> str:
    return re.sub(r"\s+", " ", "" if text is None else str(text)).strip().lower()


def grade_exact_match(answer: str | None, label, metadata: dict) -> float:
    return float(_spaces_lowered(answer) == _spaces_lowered(label))


def _squad_tokens(text: Any) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    lowered = ("" if text is None else str(text)).lower()
    no_punctuation = "".join(ch for ch in lowered if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", no_punctuation).split()


def grade_f1(answer: str | None, label, metadata: dict) -> float:
    """SQuAD token F1 (the reference's ``f1``): yes / no / noanswer must match exactly."""
    predicted, gold = _squad_tokens(answer), _squad_tokens(label)
    closed = {"yes", "no", "noanswer"}
    if (" ".join(predicted) in closed or " ".join(gold) in closed) and predicted != gold:
        return 0.0
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def grade_char_accuracy(answer: str | None, label, metadata: dict) -> float:
    """Fraction of the label's characters reproduced at the same position (vime-specific)."""
    gold, predicted = "" if label is None else str(label), ("" if answer is None else str(answer)).strip()
    if not gold:
        return float(not predicted)
    return sum(1 for g, p in zip(gold, predicted) if g == p) / len(gold)


def grade_random(answer: str | None, label, metadata: dict) -> float:
    """0 or 1 at random: a baseline for checking a pipeline, never a training signal."""
    return float(random.randint(0, 1))


# ---------------------------------------------------------------------- math: boxed answers
def grade_math_answer(answer: str | None, label, metadata: dict) -> float:
    truth = answer_of_label(label)
    if answer is None or not truth.strip():
        return 0.0
    return 1.0 if math_answers_match(answer, truth) else 0.0


def deepscaler_answer(response: str) -> str | None:
    """DeepScaleR's rule: only a response that finished thinking (``</think>``, or a ``###Response``
    section) has an answer, the last box after it."""
    if "</think>" in response:
        solution = after_thinking(response)
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return None
    return last_boxed_answer(solution)


# ---------------------------------------------------------------------- DAPO: "Answer: ..." lines
DAPO_TAIL_CHARS = 300  # the reference reads only the response's tail (MATH's longest answer is 159 chars)
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# The Minerva normaliser's rewrites and removals (the reference's lists): articles, spacing, units and
# filler words that a numeric answer may carry.
_MINERVA_REWRITES = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    *("square ways integers dollars mph inches hours km units sue points feet minutes digits cents".split()),
    *("degrees cm gm pounds meters meals edges students childrentickets multiples".split()),
    *("\\ldots", "\\dots", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}"),
    *("\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"'),
    *("<|im_end|>", "<|endoftext|>"),
)


def minerva_normalize(answer: str) -> str:
    """A final answer as the Minerva / DAPO grader compares it."""
    text = str(answer).split("=")[-1]
    for before, after in _MINERVA_REWRITES:
        text = text.replace(before, after)
    for removed in _MINERVA_REMOVED:
        text = text.replace(removed, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", text)  # the first $...$ holds the answer
    for command in ("text", "textbf", "overline"):
        text = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", text)
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text)  # \sqrt2 -> \sqrt{2}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    # vime: a full stop that ends the answer's sentence is not part of it (the reference would count
    # "Answer: 42." wrong).
    return text.strip().rstrip(".")


def dapo_answer(response: str) -> str | None:
    lines = _ANSWER_LINE.findall(response[-DAPO_TAIL_CHARS:])
    return lines[-1] if lines else None


def grade_dapo(answer: str | None, label, metadata: dict) -> dict:
    """DAPO's reward: +1 for the right integer, -1 otherwise; a dict with ``score``, ``acc`` and ``pred``."""
    predicted = minerva_normalize(answer) if answer is not None else "[INVALID]"
    truth = minerva_normalize(answer_of_label(label))
    try:
        truth = str(int(float(truth)))  # DAPO-Math's answers are integers
    except ValueError:
        pass  # a non-integer label is compared as normalised text
    correct = predicted == truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}


# ---------------------------------------------------------------------- GPQA: letter choices
DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
_LETTER_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b", re.IGNORECASE),
    re.compile(r"\(?([A-Z])\)?\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*\(?([A-Z])\b", re.IGNORECASE),
)


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def chosen_letter(text: str, letters: tuple[str, ...]) -> str | None:
    """The option a response picks: a phrase such as "the answer is (C)" or "C is correct", else its last
    standalone capital letter that names an option."""
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in letters:
            return letter
    return None


def grade_gpqa(answer: str | None, label, metadata: dict) -> float:
    """Multiple choice: the label is the right letter (``"C"``), its index (2) or its text (matched
    against ``metadata["choices"]``); ``metadata["correct_letter"]`` and ``["valid_letters"]`` may say so
    explicitly. Without a letter in the response, containing the right option's text counts."""
    text = answer or ""
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    if metadata.get("valid_letters"):
        letters = tuple(str(letter).upper() for letter in metadata["valid_letters"])
    else:
        letters = tuple(string.ascii_uppercase[: len(choices)]) if choices else DEFAULT_LETTERS
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if correct is None and label_text and len(label_text) == 1 and label_text.upper() in letters:
        correct = label_text.upper()
    elif correct is None and isinstance(label, (int, float)) and not isinstance(label, bool):
        correct = letters[int(label)] if 0 <= int(label) < len(letters) else None
    if correct is None and label_text and choices:
        by_text = [i for i, choice in enumerate(choices) if _words(str(choice)) == _words(label_text)]
        correct = letters[by_text[0]] if by_text and by_text[0] < len(letters) else None

    picked = chosen_letter(text, letters)
    if picked and correct:
        return float(picked == correct)
    # No letter to compare: the right option's text written out in the response counts.
    targets = [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if correct and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    if label_text:
        targets.append(label_text)
    written = _words(text)
    return float(any(_words(t) and _words(t) in written for t in targets))


# ---------------------------------------------------------------------- the table
def _whole(response: str) -> str:
    return response


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("exact_match", _whole, grade_exact_match),
        Rule("f1", _whole, grade_f1),
        Rule("char_accuracy", _whole, grade_char_accuracy),
        Rule("math", last_boxed_answer, grade_math_answer, symbolic=True),
        Rule("deepscaler", deepscaler_answer, grade_math_answer, symbolic=True),
        Rule("dapo", dapo_answer, grade_dapo, dict_reward_key="score"),
        Rule("gpqa", after_thinking, grade_gpqa),
        Rule("random", _whole, grade_random),
    )
}


def split_rm_type(rm_type: str) -> tuple[Rule, bool]:
    """(the rule, whether only a boxed answer counts) of an rm type such as ``boxed_math``; KeyError when
    the name is none of the rules."""
    boxed = rm_type.startswith(BOXED_PREFIX)
    return RULES[rm_type[len(BOXED_PREFIX) :] if boxed else rm_type], boxed


def score_with_rule(rm_type: str, response: str, label, metadata: dict) -> float | dict:
    """The reward of a response under the rule ``rm_type`` (a plain function: picklable, for the reward
    process)."""
    rule, boxed = split_rm_type(rm_type)
    text = response or ""
    answer = last_boxed_answer(text) if boxed else rule.find_answer(text)
    return rule.grade(answer, label, metadata)
