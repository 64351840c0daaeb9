"""The majority task: prompts are odd-length strings of a's and b's with lengths from
data.task_config's range, answers the letter in the majority, scored by exact match; examples
whose fields disagree and task configs it cannot use are rejected."""

from __future__ import annotations

import random
import statistics

import pytest

from rl.config import DataConfig
from rl.config.checks import ConfigError
from rl.config.recipe import load_config
from rl.data.tasks import get_task
from tests.helpers.repo import REPO

LONG = DataConfig(task="majority", task_config={"min_length": 2000, "max_length": 3000})


def test_generate_is_deterministic_and_answers_count_the_letters() -> None:
    task = get_task("majority")
    examples = task.generate(LONG, 200, random.Random(3))
    assert examples == task.generate(LONG, 200, random.Random(3))
    assert examples != task.generate(LONG, 200, random.Random(4))
    for example in examples:
        prompt = example["prompt"]
        assert set(prompt) <= {"a", "b"} and len(prompt) % 2 == 1
        assert 2000 <= len(prompt) <= 3000
        a, b = prompt.count("a"), prompt.count("b")
        assert example["answer"] == ("a" if a > b else "b")
        assert task.score(example["answer"], example) == 1.0


def test_lengths_are_uniform_over_the_odd_lengths_of_the_range() -> None:
    cfg = DataConfig(task="majority", task_config={"min_length": 10, "max_length": 14})
    lengths = [
        len(ex["prompt"]) for ex in get_task("majority").generate(cfg, 3000, random.Random(0))
    ]
    assert set(lengths) == {11, 13}
    assert lengths.count(11) / len(lengths) == pytest.approx(0.5, abs=0.03)
    defaults = get_task("majority").generate(DataConfig(task="majority"), 300, random.Random(0))
    assert {len(ex["prompt"]) for ex in defaults} <= set(range(63, 256, 2))


def test_the_share_of_a_is_uniform_within_a_tenth_of_even() -> None:
    examples = get_task("majority").generate(LONG, 2000, random.Random(1))
    # share ~ U(0.4, 0.6), then ~2500 draws of it: the letters' share of a scatters around
    # the drawn one by at most 0.01 in sd, so |share - 0.5| is U(0, 0.1) blurred a little:
    # mean 0.05, and each half of the range holds about half of the prompts.
    offsets = [abs(ex["prompt"].count("a") / len(ex["prompt"]) - 0.5) for ex in examples]
    assert max(offsets) < 0.1 + 0.04
    assert statistics.mean(offsets) == pytest.approx(0.05, abs=0.004)
    assert sum(o < 0.05 for o in offsets) / len(offsets) == pytest.approx(0.5, abs=0.04)
    answers = [ex["answer"] for ex in examples]
    assert answers.count("a") / len(answers) == pytest.approx(0.5, abs=0.04)


EXAMPLE = {"prompt": "abbab", "answer": "b"}


@pytest.mark.parametrize(
    ("response", "reward"),
    [("b", 1.0), (" b\n", 1.0), ("a", 0.0), ("bb", 0.0), ("B", 0.0), ("", 0.0), ("\x00", 0.0)],
)
def test_score_is_exact(response: str, reward: float) -> None:
    assert get_task("majority").score(response, EXAMPLE) == reward


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt": "abba"}, "prompt"),  # even: a tie is possible
        ({"prompt": "abc"}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"answer": "a"}, "answer"),
        ({"answer": None}, "answer"),
    ],
)
def test_bad_examples_are_rejected_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        get_task("majority").score("b", {**EXAMPLE, **change})


@pytest.mark.parametrize(
    ("task_config", "message"),
    [
        ({"length": 5}, "unknown key 'length'"),
        ({"min_length": 0}, "min_length=0"),
        ({"min_length": 9, "max_length": 7}, "min_length=9"),
        ({"min_length": 4, "max_length": 4}, "odd number"),
        ({"max_length": "300"}, "max_length='300'"),
    ],
)
def test_task_configs_it_cannot_use_are_refused(task_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_task("majority").check(DataConfig(task="majority", task_config=task_config))


def test_a_recipe_with_a_bad_task_config_is_refused_when_loaded() -> None:
    with pytest.raises(ConfigError, match="data.task_config"):
        load_config(
            REPO / "recipes" / "grpo_majority_sp_cpu.yaml", ["data.task_config.max_length=one"]
        )
