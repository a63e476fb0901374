"""Whether two math answers are the same: a light LaTeX normalisation, then math-verify's symbolic check.

Used by the ``math`` and ``deepscaler`` rewards. The reference framework grades with the MATH dataset's
normaliser and a sympy difference; vime keeps that grader's two deliberate strictnesses and leaves the
algebra to math-verify (HuggingFace's verifier, on sympy):

- an integer answer must be written as a number (``3``, ``3.0``, ``1,000``), not an expression that
  evaluates to it (``\\sqrt{9}``), so that a model cannot be paid for leaving the work undone;
- two plain fractions match only as written (``\\frac{2}{4}`` is not the reduced ``\\frac{1}{2}``).

Symbolic comparison can take very long on adversarial input (``10^{10^{10}}``): answers that look like
that, or are longer than a final answer ever is, are compared as text only. math-verify's own time limit
(``signal.alarm``) applies on a process's main thread, which is where vime's reward process runs them
(vime.rollout.rm_hub.grading_process).
"""

from __future__ import annotations

import re
import threading

SYMBOLIC_TIMEOUT_SECONDS = 5
MAX_SYMBOLIC_LENGTH = 400

# What a final answer may be wrapped in that changes nothing: math delimiters, spacing commands, \left/\right.
_DROPPED = ("\\!", "\\,", "\\;", "\\:", "\\left", "\\right", "\\displaystyle", "\\$", "$", "\\(", "\\)", "\\[", "\\]")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_PERCENT = re.compile(r"\\?%")
# A trailing unit written as text after a number ("10\text{ cm}", "5 \mbox{ meters}").
_TEXT_UNIT = re.compile(r"^(?P<value>.*?[0-9}])\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?\d\}?)?$")
_WHOLE_TEXT = re.compile(r"^\\(?:text|mbox|textbf|mathrm)\{(?P<inner>[^{}]*)\}$")
# "x = 3", "k=-1": a short name on the left of a single '=' is dropped (the MATH normaliser's rule).
_SHORT_LHS = re.compile(r"^\s*[A-Za-z][A-Za-z0-9_']{0,1}\s*=(?!=)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_FRACTION = re.compile(
    r"^(?P<sign>[+-]?)(?:\\frac\{(?P<n1>[+-]?\d+)\}\{(?P<d1>\d+)\}|\\frac(?P<n2>\d)(?P<d2>\d)|(?P<n3>[+-]?\d+)/(?P<d3>\d+))$"
)
# Answers sympy could spend minutes on: towers of powers, huge exponents, factorials of big numbers.
_EXPENSIVE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\{?\s*\d{3,}|\^\s*\d\s*\^|\d{3,}\s*!")


def normalize_answer(text) -> str:
    """The answer with what does not change its meaning removed (spacing, delimiters, degrees, percent,
    units written as text, a trailing full stop, thousands separators, ``x =``)."""
    answer = "" if text is None else str(text).strip()
    answer = answer.replace("\n", " ").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for dropped in _DROPPED:
        answer = answer.replace(dropped, "")
    answer = _DEGREES.sub("", answer)
    answer = _PERCENT.sub("", answer)
    answer = answer.strip().rstrip(".").strip()  # "5." ends a sentence; "0.5" keeps its point
    if (unit := _TEXT_UNIT.match(answer)) is not None:
        answer = unit.group("value")
    if (whole := _WHOLE_TEXT.match(answer)) is not None:
        answer = whole.group("inner").strip()
    answer = _SHORT_LHS.sub("", answer, count=1) if answer.count("=") == 1 else answer
    answer = _THOUSANDS.sub("", answer)
    return re.sub(r"\s+", "", answer)


def _as_fraction(answer: str) -> tuple[int, int] | None:
    match = _FRACTION.match(answer)
    if match is None:
        return None
    numerator = match.group("n1") or match.group("n2") or match.group("n3")
    denominator = match.group("d1") or match.group("d2") or match.group("d3")
    sign = -1 if match.group("sign") == "-" else 1
    return sign * int(numerator), int(denominator)


def _is_integer_literal(answer: str) -> bool:
    return bool(_NUMBER.match(answer)) and float(answer) == int(float(answer))


def math_answers_match(given, truth) -> bool:
    """Whether the answer ``given`` means the same as the reference answer ``truth`` (both bare answers,
    already taken out of their ``\\boxed{}``)."""
    given_text, truth_text = normalize_answer(given), normalize_answer(truth)
    if not given_text or not truth_text:
        return False
    if given_text == truth_text or given_text.lower() == truth_text.lower():
        return True
    if _is_integer_literal(truth_text):
        return bool(_NUMBER.match(given_text)) and float(given_text) == float(truth_text)
    given_fraction, truth_fraction = _as_fraction(given_text), _as_fraction(truth_text)
    if given_fraction is not None and truth_fraction is not None:
        return given_fraction == truth_fraction
    if any(len(t) > MAX_SYMBOLIC_LENGTH or _EXPENSIVE.search(t) for t in (given_text, truth_text)):
        return False
    return _symbolically_equal(given_text, truth_text)


def _symbolically_equal(given: str, truth: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify limits its own time with signal.alarm, which only the main thread may set; elsewhere it
    # must be told not to (it would refuse), and the length/expense screen above is the only guard.
    limit = SYMBOLIC_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"${truth}$", extraction_config=configs, parsing_timeout=limit)
    answer = parse(f"${given}$", extraction_config=configs, parsing_timeout=limit)
    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=limit))
