"""The environment of the multi-turn tool-use example: arithmetic problems and a calculator tool.

Problems are "a+b=" or "a*b=" with a, b in 0..99; the label is the value. The calculator evaluates
what the model wrote in its first turn (digits, '+' and '*', no parentheses) and answers "?" -
rendered as "0" - when it cannot.
"""

from __future__ import annotations

import random
import re

CHARS = "0123456789+*="  # the tiny model's vocabulary for this task (make_tiny_model --chars)
EXPRESSION = re.compile(r"^\d{1,3}([+*]\d{1,3})*$")


def problem(index: int, seed: int = 0) -> tuple[str, str, str]:
    """(prompt, label, operation) of problem ``index``: deterministic in (index, seed)."""
    rng = random.Random(seed * 1_000_003 + index)
    a, b = rng.randrange(100), rng.randrange(100)
    operation = "add" if index % 2 == 0 else "mul"
    sign, value = ("+", a + b) if operation == "add" else ("*", a * b)
    return f"{a}{sign}{b}=", str(value), operation


def calculator(expression: str) -> str:
    """Evaluate ``expression`` ('12+7', '3*4+1'); '0' when it is not a valid expression."""
    expression = expression.strip()
    if not EXPRESSION.match(expression):
        return "0"
    total = 0
    for term in expression.split("+"):
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += product
    return str(total)[:6]
