"""Task generation is deterministic and well-formed; verifiers are exact and junk-proof."""

from __future__ import annotations

import random

import pytest

from rl.config import DataConfig
from rl.data.tasks import TASKS, get_task
from rl.data.tasks.countdown import evaluate_expression


def test_registry_lists_valid_names() -> None:
    assert TASKS.names() == [
        "addition",
        "countdown",
        "majority",
        "math",
        "openenv",
        "reasoning_gym",
        "repeat",
        "verifiers",
    ]
    with pytest.raises(
        ValueError,
        match="addition, countdown, majority, math, openenv, reasoning_gym, repeat, verifiers",
    ):
        get_task("subtraction")


@pytest.mark.parametrize("name", ["addition", "countdown"])
def test_generate_is_deterministic_and_self_consistent(name: str) -> None:
    task = get_task(name)
    cfg = DataConfig(task=name, num_operands=4)
    first = task.generate(cfg, 50, random.Random(7))
    assert first == task.generate(cfg, 50, random.Random(7))
    assert first != task.generate(cfg, 50, random.Random(8))
    assert len(first) == 50
    for example in first:
        assert isinstance(example["prompt"], str) and isinstance(example["answer"], str)
        assert task.score(example["answer"], example) == 1.0


@pytest.mark.parametrize("digits", [1, 3, 5])
@pytest.mark.parametrize("zero_pad", [True, False])
def test_addition_operands_and_answers(digits: int, zero_pad: bool) -> None:
    cfg = DataConfig(num_digits=digits, zero_pad=zero_pad)
    for example in get_task("addition").generate(cfg, 30, random.Random(0)):
        a, b = example["prompt"].split("+")
        assert len(a) == len(b) == digits
        assert int(example["answer"]) == int(a) + int(b)
        if zero_pad:  # one digit wider than the operands, whatever the carry
            assert len(example["answer"]) == digits + 1
        else:
            assert example["answer"] == str(int(a) + int(b))


@pytest.mark.parametrize(
    ("response", "reward"),
    [("0579", 1.0), (" 0579\n", 1.0), ("579", 0.0), ("0 579", 0.0), ("0579.", 0.0), ("", 0.0)],
)
def test_addition_score(response: str, reward: float) -> None:
    assert get_task("addition").score(response, {"prompt": "123+456", "answer": "0579"}) == reward


@pytest.mark.parametrize("num_operands", [3, 4])
def test_countdown_prompts(num_operands: int) -> None:
    task = get_task("countdown")
    for ex in task.generate(DataConfig(num_operands=num_operands), 30, random.Random(1)):
        assert len(ex["numbers"]) == num_operands
        assert ex["prompt"] == f"{' '.join(map(str, ex['numbers']))} -> {ex['target']}"
        assert 0 < ex["target"] <= 999


def test_countdown_rejects_bad_operand_count() -> None:
    with pytest.raises(ValueError, match="num_operands"):
        get_task("countdown").generate(DataConfig(num_operands=5), 1, random.Random(0))


COUNTDOWN = {"prompt": "2 3 6 7 -> 13", "answer": "2*3+7", "numbers": [2, 3, 6, 7], "target": 13}


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("6+7", 1.0),  # a subset of the numbers is allowed
        ("(7-6)*2*3+7", 0.0),  # 7 used twice
        ("2*(3+7)-7", 0.0),  # 7 used twice, value right
        ("6*2+7-3*2", 0.0),  # 2 used twice
        ("7*(2+3)-6*3", 0.0),
        ("(6*3+7)/2+0.5", 0.0),  # float literal
        ("13", 0.0),  # not a given number
        ("6 + 7 = 13", 1.0),
        ("((6+7))", 1.0),
        ("7/(3-3)+6", 0.0),  # division by zero (and 3 reused)
        ("6/(7-7)", 0.0),
        ("-2+6+7+2", 0.0),  # unary minus is not one of the four operators
        ("6**2-7*3-2", 0.0),  # power
        ("6//2+7+3", 0.0),  # floor division
        ("__import__('os').system('true')", 0.0),  # names, calls, attributes
        ("abs(6)+7", 0.0),
        ("x.y+7", 0.0),
        ("6+7)", 0.0),
        ("1_3", 0.0),
        ("(" * 500 + "6+7" + ")" * 500, 0.0),  # too long / too deep
        ("\x00\xff junk", 0.0),
    ],
)
def test_countdown_score(response: str, reward: float) -> None:
    assert get_task("countdown").score(response, COUNTDOWN) == reward


def test_countdown_exact_fractions() -> None:
    # Intermediate non-integers are fine: 7/2*2 is exactly 7.
    example = {"numbers": [2, 3, 7, 2], "target": 7}
    assert get_task("countdown").score("7/3*3", example) == 0.0  # 3 reused
    assert get_task("countdown").score("7/2*2", example) == 1.0  # two 2s given
    assert get_task("countdown").score("(2+3)/2*2+2", example) == 0.0  # three 2s


def test_ast_walker_rejects_non_arithmetic_nodes() -> None:
    # These pass the character filter, so the ast walker itself must refuse them.
    for text in ["-3", "+3", "2**3", "2//3", "()", "(1)(2)"]:
        with pytest.raises((ValueError, SyntaxError)):
            evaluate_expression(text)
    with pytest.raises(ZeroDivisionError):
        evaluate_expression("1/(2-2)")


def test_math_task_reads_files_and_checks_answers_by_value() -> None:
    task = get_task("math")
    assert task.needs_files
    with pytest.raises(ValueError, match="data.train_files"):
        task.generate(DataConfig(task="math"), 1, random.Random(0))
    example = {"prompt": "Half of one?", "answer": "0.5"}
    assert task.score("so the answer is \\boxed{\\frac{1}{2}}", example) == 1.0
    assert task.score("\\boxed{0.25}", example) == 0.0
