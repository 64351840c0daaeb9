"""Rule-based verifiers: `fn(response, example) -> float`, registered by name in `VERIFIERS`.

A reward term names one of these; the data task's own scorer is the term `task`.
"""

from __future__ import annotations

from collections.abc import Callable

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
    """1.0 when the final answer in `response` equals `example["answer"]` mathematically
    (math-verify on both sides; the math task's rule). Raises on a gold answer it cannot read."""
    return get_task("math").score(response, example)
