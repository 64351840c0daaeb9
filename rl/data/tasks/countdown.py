"""Countdown: reach a target from given numbers with + - * / (prompt "3 7 25 50 -> 175").

Responses are arithmetic expressions. They are parsed with `ast` and evaluated by a walker
that knows only integer literals and the four operators; nothing is ever `eval`-ed.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

MAX_NUMBER = 30  # given numbers are drawn from 1..MAX_NUMBER
MAX_TARGET = 999  # targets above this are redrawn, keeping prompts short
MAX_RESPONSE_CHARS = 200  # longer responses are junk; also bounds the parser's work
_ALLOWED_CHARS = frozenset("0123456789+-*/() \t")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b  # ZeroDivisionError is the caller's to handle


def _operand(expr: tuple[str, str], parent_op: str, right: bool) -> str:
    """`expr` = (text, top-level op or "") as an operand of `parent_op`, parenthesised if needed."""
    text, op = expr
    if not op:
        return text
    prec, parent_prec = _PRECEDENCE[op], _PRECEDENCE[parent_op]
    # a-(b+c) and a/(b*c) need parentheses on the right even at equal precedence.
    if prec < parent_prec or (right and prec == parent_prec and parent_op in "-/"):
        return f"({text})"
    return text


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, int] | None:
    """Combine all `numbers` in a random tree; None if an intermediate is not a positive int."""
    items = [(Fraction(n), (str(n), "")) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or a % b):
            return None
        value = _apply(op, a, b)
        if value <= 0 or value.denominator != 1:
            return None
        text = f"{_operand(ea, op, False)}{op}{_operand(eb, op, True)}"
        items = [item for k, item in enumerate(items) if k not in (i, j)]
        items.append((value, (text, op)))
    value, (text, _) = items[0]
    return text, int(value)


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression tree; ValueError on anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        return _apply(_OPS[type(node.op)], left, right)
    raise ValueError(f"disallowed syntax: {type(node).__name__}")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """(value, literals used) of an arithmetic expression; ValueError/ZeroDivisionError if bad."""
    if len(text) > MAX_RESPONSE_CHARS or not set(text) <= _ALLOWED_CHARS:
        raise ValueError("not a plain arithmetic expression")
    used: list[int] = []
    value = _evaluate(ast.parse(text.strip(), mode="eval").body, used)
    return value, used


@TASKS.register("countdown")
class Countdown(Task):
    name = "countdown"
    param_fields = ("num_operands",)

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        if cfg.num_operands not in (3, 4):
            raise ValueError(f"data.num_operands must be 3 or 4, got {cfg.num_operands}")
        examples = []
        while len(examples) < num:
            numbers = [rng.randint(1, MAX_NUMBER) for _ in range(cfg.num_operands)]
            made = _random_expression(numbers, rng)
            if made is None or made[1] > MAX_TARGET:
                continue
            expression, target = made
            numbers.sort()  # the prompt must not reveal the reference tree's order
            prompt = f"{' '.join(map(str, numbers))} -> {target}"
            examples.append(
                {"prompt": prompt, "answer": expression, "numbers": numbers, "target": target}
            )
        return examples

    def score(self, response: str, example: dict) -> float:
        # "expr = target" is accepted as well as a bare expression.
        text = response.split("=", 1)[0]
        try:
            value, used = evaluate_expression(text)
        except (ValueError, SyntaxError, ZeroDivisionError, RecursionError, MemoryError):
            return 0.0
        # Each given number at most once: the literals used must be a sub-multiset.
        if Counter(used) - Counter(example["numbers"]):
            return 0.0
        return 1.0 if value == example["target"] else 0.0
