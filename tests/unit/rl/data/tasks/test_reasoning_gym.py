"""reasoning-gym datasets as tasks (data.task: reasoning_gym:<dataset>), with the real package:
splits are deterministic and disjoint, rewards are the dataset's own score_answer, and a bad
dataset or config key fails before any work, naming the key and the valid names."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import reasoning_gym

from rl.config import DataConfig
from rl.config.recipe import ConfigError, load_config
from rl.data.loading import prepare_splits, split_dir
from rl.data.tasks import get_task
from rl.data.tasks.reasoning_gym import decode, encode
from tests.helpers.repo import REPO

CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def data_config(tmp_path: Path, **fields: object) -> DataConfig:
    fields = {"task": "reasoning_gym:chain_sum", "task_config": CHAIN_SUM} | fields
    return DataConfig(dir=str(tmp_path), num_train=200, num_test=50, **fields)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_splits_are_deterministic_disjoint_and_keyed_by_the_task_config(tmp_path: Path) -> None:
    cfg = data_config(tmp_path / "a")
    paths = prepare_splits(cfg)
    train, test = read_jsonl(paths["train"]), read_jsonl(paths["test"])
    assert (len(train), len(test)) == (200, 50)
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in test}
    # Made again from nothing (another directory, no cached files): the same files.
    again = prepare_splits(data_config(tmp_path / "b"))
    for split in ("train", "test"):
        assert again[split].read_text() == paths[split].read_text()
    assert read_jsonl(prepare_splits(data_config(tmp_path / "c", seed=7))["test"]) != test
    other = data_config(tmp_path / "a", task_config=CHAIN_SUM | {"max_terms": 2})
    assert split_dir(other) != split_dir(cfg)
    assert ":" not in split_dir(cfg).name


def test_examples_are_the_datasets_entries_and_score_as_its_own_score_answer(
    tmp_path: Path,
) -> None:
    cfg = data_config(tmp_path)
    task = get_task(cfg.task)
    oracle = reasoning_gym.create_dataset("chain_sum", **CHAIN_SUM)  # an independent scorer
    for example in read_jsonl(prepare_splits(cfg)["test"]):  # as they come back from the file
        entry = decode(example["reasoning_gym"])["entry"]
        assert example["prompt"] == entry["question"]
        assert example["answer"] == entry["answer"]
        assert f"{entry['metadata']['expression']} =" in example["prompt"]
        correct, junk = example["answer"], "banana"
        assert task.score(correct, example) == oracle.score_answer(correct, entry) == 1.0
        assert task.score(junk, example) == oracle.score_answer(junk, entry) == 0.0
        assert task.score(f" {correct}\n", example) == 1.0
        assert task.score(f"work<answer>{correct}</answer>", example) == 1.0
        wrong = str(int(correct) + 1)
        assert task.score(wrong, example) == oracle.score_answer(wrong, entry) < 1.0


def test_responses_are_stripped_before_an_exact_match_scorer_sees_them(tmp_path: Path) -> None:
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "allow_parentheses": False}
    cfg = data_config(tmp_path, task="reasoning_gym:basic_arithmetic", task_config=config)
    task = get_task(cfg.task)
    oracle = reasoning_gym.create_dataset("basic_arithmetic", **config)
    for example in task.generate(cfg, 20, random.Random(0)):
        entry = decode(example["reasoning_gym"])["entry"]
        padded = f" {example['answer']}\n"
        assert oracle.score_answer(padded, entry) < 1.0  # its scorer compares exactly
        assert task.score(padded, example) == 1.0


def test_score_is_a_float_in_0_1_and_never_raises_on_junk(tmp_path: Path) -> None:
    task = get_task("reasoning_gym:chain_sum")
    (example,) = task.generate(data_config(tmp_path), 1, random.Random(0))
    answer = example["answer"]
    for junk in ["", " ", "\x00\xff", "1e999999", "nan", "-" * 10_000, f"{answer}{answer}"]:
        reward = task.score(junk, example)
        assert isinstance(reward, float) and 0.0 <= reward <= 1.0, junk


def test_a_scorer_that_raises_or_returns_junk_scores_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    task = get_task("reasoning_gym:chain_sum")
    (example,) = task.generate(data_config(tmp_path), 1, random.Random(0))
    scorer_class = type(reasoning_gym.create_dataset("chain_sum"))
    for result in [RuntimeError("parser crashed"), float("nan"), 7.0, -1.0, "x"]:

        def score_answer(self: object, answer: str, entry: dict, result: object = result) -> object:
            if isinstance(result, Exception):
                raise result
            return result

        monkeypatch.setattr(scorer_class, "score_answer", score_answer)
        expected = 1.0 if result == 7.0 else 0.0  # clamped into [0, 1]
        assert task.score(example["answer"], example) == expected, result


def test_an_example_the_task_did_not_make_is_a_value_error() -> None:
    task = get_task("reasoning_gym:chain_sum")
    with pytest.raises(ValueError, match="no readable 'reasoning_gym' field"):
        task.score("3", {"prompt": "1+2", "answer": "3"})
    other = {"prompt": "p", "answer": "3", "reasoning_gym": encode("leg_counting", {}, {})}
    with pytest.raises(ValueError, match="cannot score an example of reasoning_gym:leg_counting"):
        task.score("3", other)


def test_entries_read_back_with_their_tuples_and_non_string_keys() -> None:
    entry = {"answer": "x", "metadata": {"grid": ((1, 2), (3,)), "map": {(0, 1): [1], 2: "b"}}}
    config = {"operators": ["+"]}
    saved = decode(encode("ds", config, entry))
    assert saved == {"dataset": "ds", "config": config, "entry": entry}
    grid = saved["entry"]["metadata"]["grid"]
    assert type(grid) is tuple and type(grid[0]) is tuple
    with pytest.raises(ValueError, match="cannot be saved"):
        encode("ds", {}, {"metadata": {"s": {1, 2}}})


def test_unknown_dataset_names_data_task_and_the_valid_datasets() -> None:
    with pytest.raises(ValueError, match=r"data.task='reasoning_gym:chain_summ'.*chain_sum"):
        get_task("reasoning_gym:chain_summ")
    with pytest.raises(ValueError, match=r"data.task='reasoning_gym' needs a dataset.*chain_sum"):
        get_task("reasoning_gym")


def test_unknown_task_config_key_names_the_key_and_the_valid_keys(tmp_path: Path) -> None:
    task = get_task("reasoning_gym:chain_sum")
    bad = data_config(tmp_path, task_config={"max_term": 3})
    message = r"data.task_config: unknown key 'max_term'.*valid: min_terms, max_terms"
    with pytest.raises(ValueError, match=message):
        task.check(bad)
    with pytest.raises(ValueError, match=message):  # generating checks too
        task.generate(bad, 1, random.Random(0))
    with pytest.raises(ValueError, match="data.task_config.seed: set by data.seed"):
        task.check(data_config(tmp_path, task_config={"seed": 3}))
    with pytest.raises(ValueError, match=r"data.task_config .* max_terms must be >= min_terms"):
        task.check(data_config(tmp_path, task_config={"min_terms": 3, "max_terms": 2}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.task_config.max_term=3"], r"data.task_config: unknown key 'max_term'"),
        (["data.task=reasoning_gym:nope"], r"data.task='reasoning_gym:nope'.*chain_sum"),
        (["data.task=addition"], r"data.task_config is set but data.task=addition takes none"),
    ],
)
def test_recipe_with_a_bad_dataset_or_key_fails_at_load_naming_it(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=rf"grpo_reasoning_gym_cpu.yaml: {message}"):
        load_config(REPO / "recipes/grpo_reasoning_gym_cpu.yaml", overrides)


def test_dotted_overrides_set_task_config_keys() -> None:
    recipe = REPO / "recipes/grpo_reasoning_gym_cpu.yaml"
    written = load_config(recipe).data.task_config
    cfg = load_config(recipe, [f"data.task_config.max_terms={written['max_terms'] + 1}"])
    assert cfg.data.task.startswith("reasoning_gym:")
    assert cfg.data.task_config == written | {"max_terms": written["max_terms"] + 1}


def test_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install -e \.\[reasoning-gym\]"):
        get_task("reasoning_gym:chain_sum")
