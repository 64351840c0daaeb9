"""Rule-based verifiers: `fn(response, example) -> float`, registered by name in `VERIFIERS`.

A reward term names one of these; the data task's own scorer is the term `task`.
"""

from __future__ import annotations

from collections.abc import Callable

from math_verify import parse, verify

from rl.config.registry import NoTraits, Registry
from rl.data.tasks import get_task

Verifier = Callable[[str, dict], float]
VERIFIERS: Registry[Verifier, NoTraits] = Registry("verifier")


@VERIFIERS.register("countdown")
def countdown(response: str, example: dict) -> float:
    """1.0 when `response` is an expression of the given numbers reaching the target."""
    return get_task("countdown").score(response, example)


@VERIFIERS.register("arithmetic")
def arithmetic(response: str, example: dict) -> float:
    """1.0 when `response` is exactly `example["answer"]` (the addition task's rule)."""
    return get_task("addition").score(response, example)


@VERIFIERS.register("math")
def math_answer(response: str, example: dict) -> float:
    """1.0 when the final answer in `response` equals `example["answer"]` mathematically.

    Both sides go through math-verify, so `\\boxed{1/2}` matches a gold `0.5` or `\\frac{1}{2}`.
    A gold answer math-verify cannot read raises: a data bug must show up as an error, not as
    a silent zero for every response.
    """
    answer = str(example["answer"])
    # Bare gold answers ("x^2+1", "\sqrt{2}") parse only inside a math environment.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    if not gold:
        raise ValueError(f"math-verify could not parse the gold answer {answer!r}")
    return 1.0 if verify(gold, parse(response)) else 0.0
