"""The repeat task: answers are the pattern written count times, each after its number counted
down, counts log-normal so that answer lengths have a heavy tail, scored by exact match;
examples whose fields disagree are rejected."""

from __future__ import annotations

import math
import random
import re
from statistics import NormalDist

import pytest

from rl.config import DataConfig
from rl.data.tasks import get_task
from rl.data.tasks.repeat import MAX_ANSWER, MEDIAN_COUNT, SIGMA

CFG = DataConfig(task="repeat")


def test_generate_is_deterministic_and_answers_count_the_pattern_down() -> None:
    task = get_task("repeat")
    examples = task.generate(CFG, 300, random.Random(3))
    assert examples == task.generate(CFG, 300, random.Random(3))
    assert examples != task.generate(CFG, 300, random.Random(4))
    for example in examples:
        pattern, count = example["prompt"].split("*")
        assert pattern == example["pattern"] and int(count) == example["count"]
        assert 1 <= len(pattern) <= 3 and pattern.isalpha() and pattern.islower()
        # Read back from the answer: the numbers, each followed by the pattern.
        parts = re.findall(r"(\d+)([a-z]+)", example["answer"])
        assert "".join(n + p for n, p in parts) == example["answer"]
        assert [int(n) for n, _ in parts] == list(range(int(count), 0, -1))
        assert {p for _, p in parts} == {pattern}
        assert len(example["answer"]) <= MAX_ANSWER
        assert task.score(example["answer"], example) == 1.0


def test_counts_follow_the_truncated_log_normal() -> None:
    draws = get_task("repeat").generate(CFG, 20000, random.Random(0))
    counts = [ex["count"] for ex in draws]
    # count = round(X), X ~ exp(N(log MEDIAN_COUNT, SIGMA)), at least 1; a pattern of p letters
    # allows counts up to n_max(p), whose answer n*p + the digits of 1..n fits MAX_ANSWER;
    # a draw past it is redrawn, pattern size included.
    normal = NormalDist(math.log(MEDIAN_COUNT), SIGMA)

    def below(k: float) -> float:  # P(round(X) <= k)
        return normal.cdf(math.log(k + 0.5))

    def n_max(p: int) -> int:
        n = 1
        while (n + 1) * p + len("".join(map(str, range(1, n + 2)))) <= MAX_ANSWER:
            n += 1
        return n

    kept = sum(below(n_max(p)) for p in (1, 2, 3))
    for k in (1, 2, 4, 8, 16, 32, 64):
        expected = sum(below(min(k, n_max(p))) for p in (1, 2, 3)) / kept
        measured = sum(c <= k for c in counts) / len(counts)
        assert measured == pytest.approx(expected, abs=0.005), k
    lengths = [len(ex["answer"]) for ex in draws]
    assert min(lengths) == 2 and max(lengths) >= 250  # a few tokens to a few hundred


EXAMPLE = {"prompt": "ab*3", "answer": "3ab2ab1ab", "pattern": "ab", "count": 3}


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("3ab2ab1ab", 1.0),
        (" 3ab2ab1ab\n", 1.0),
        ("3ab2ab1ab0ab", 0.0),  # one repetition too many
        ("3ab2ab", 0.0),  # a prefix
        ("ababab", 0.0),  # the repetitions without their numbers
        ("3ab 2ab 1ab", 0.0),
        ("3AB2AB1AB", 0.0),
        ("", 0.0),
        ("\x00\xff", 0.0),
    ],
)
def test_score_is_exact(response: str, reward: float) -> None:
    assert get_task("repeat").score(response, EXAMPLE) == reward


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"pattern": ""}, "pattern"),
        ({"pattern": None}, "pattern"),
        ({"pattern": "a1"}, "pattern"),
        ({"count": 0}, "count"),
        ({"count": "3"}, "count"),
        ({"count": 2.0}, "count"),
        ({"answer": "2ab1ab"}, "answer"),
        ({"answer": None}, "answer"),
    ],
)
def test_bad_examples_are_rejected_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        get_task("repeat").score("3ab2ab1ab", {**EXAMPLE, **change})


def test_an_example_without_its_fields_is_rejected() -> None:
    with pytest.raises(ValueError, match="pattern"):
        get_task("repeat").score("3ab2ab1ab", {"prompt": "ab*3", "answer": "3ab2ab1ab"})
