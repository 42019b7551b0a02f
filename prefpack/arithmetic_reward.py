"""A verifiable reward: 1.0 when a completion's first number is the sum the prompt asks for, else 0.0.

This file is standalone (the standard library only): ``prefpack quickstart --task arithmetic`` copies it as it is to
``runs/arithmetic/reward.py``, for ``rounds.reward_fn: runs/arithmetic/reward.py:exact_answer`` or
``prefpack score ... --reward-fn runs/arithmetic/reward.py:exact_answer``.

What is parsed, exactly:

- the answer: the row's ``answer`` field (the prompt files the quickstart writes carry it, and prefpack passes a
  prompt row's other fields to the function as ``row``); without one, the prompt's last ``A+B=`` (or ``A-B=``, spaces
  allowed, anything before it such as a BOS token ignored) is computed. Neither: 0.0.
- the completion's first number: the first match of ``-?\\d+(\\.\\d+)?`` anywhere in the text (an optional minus,
  ASCII digits, an optional decimal part), compared as a number: " 7", "7", "  7</s>", "7\\n3+1=4", "= 7." and "7.0"
  all read 7; "17" reads 17 (not 7), "x7" reads 7, "seven", "" and "  " have no number. Spaces, newlines and an end
  token (decoded or not: prefpack decodes completions without special tokens) around the number do not matter.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PROBLEM = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*$")


def first_number(text: str) -> float | None:
    """The first number in ``text`` (see the module's docstring), or None."""
    match = NUMBER.search(text)
    return float(match.group()) if match else None


def expected_answer(prompt: str, row: dict | None = None) -> float | None:
    """``row["answer"]`` when the row has one, else the prompt's trailing ``A+B=`` / ``A-B=`` computed, else None."""
    if row and row.get("answer") is not None:
        return float(row["answer"])
    match = PROBLEM.search(prompt)
    if not match:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return float(a + b if op == "+" else a - b)


def exact_answer(prompt: str, completion: str, row: dict | None = None) -> float:
    """1.0 when the completion's first number equals the expected answer, else 0.0 (no number, no answer: 0.0)."""
    answer, got = expected_answer(prompt, row), first_number(completion)
    return 1.0 if answer is not None and got is not None and got == answer else 0.0
