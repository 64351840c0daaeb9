"""reasoning-gym datasets as tasks: `data.task: reasoning_gym:<dataset>` (reasoning_gym:chain_sum).

Examples come from the `reasoning-gym` package (an optional extra: `pip install -e
.[reasoning-gym]`, imported only when such a task is used):
`reasoning_gym.create_dataset(name, size=..., seed=..., **data.task_config)`, one dataset per
`generate` call, its seed drawn from the split's rng (so from data.seed), its size the number of
examples asked for. The prompt is the entry's question, the answer its reference answer (empty
where the dataset has none and scores by checking the response), and the reward the dataset's
own `score_answer(answer, entry)`, which may give partial credit.

`score` gets only the example, so each example carries what scoring needs, the dataset's name
and config and the whole entry, as one JSON string (`reasoning_gym` field; one string column
keeps jsonl and Arrow from reshaping entries whose metadata differ row to row). Tuples and
dicts with non-string keys are tagged in that JSON so that an entry reads back as it was made:
some scorers compare metadata tuples with what they parse from the response.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from importlib.metadata import version
from typing import Any

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

PREFIX = "reasoning_gym"
INSTALL_HINT = "pip install -e .[reasoning-gym]"
# DataConfig fields that set these; data.task_config must not.
_SET_ELSEWHERE = {"size": "data.num_train / data.num_test", "seed": "data.seed"}
# Tags of the values plain JSON would change (see the module docstring).
_TUPLE, _ITEMS = "__tuple__", "__items__"


def _reasoning_gym(task: str) -> Any:
    """The reasoning_gym module; ValueError saying how to install it when it is missing."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ValueError(
            f"data.task={task} needs the reasoning-gym package: {INSTALL_HINT}"
        ) from exc
    return reasoning_gym


def _to_json(value: Any) -> Any:
    """`value` as plain JSON data, tuples and dicts with non-string keys tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TUPLE, _ITEMS} & value.keys():
            return {k: _to_json(v) for k, v in value.items()}
        return {_ITEMS: [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    raise TypeError(f"{type(value).__name__} value {value!r} has no JSON form")


def _from_json_object(obj: dict) -> Any:
    """json.loads' object hook: undoes `_to_json`'s tags."""
    if obj.keys() == {_TUPLE}:
        return tuple(obj[_TUPLE])
    if obj.keys() == {_ITEMS}:
        return dict(obj[_ITEMS])  # keys that were tuples are tuples again by now
    return obj


def encode(dataset: str, config: dict, entry: dict) -> str:
    """The `reasoning_gym` field of an example: what `score` needs, as one JSON string."""
    try:
        data = _to_json({"dataset": dataset, "config": config, "entry": entry})
    except TypeError as exc:
        raise ValueError(
            f"reasoning-gym dataset {dataset!r} made an entry that cannot be saved: {exc}"
        ) from None
    return json.dumps(data, sort_keys=True)


def decode(field: str) -> dict:
    """`encode`'s {"dataset", "config", "entry"} back, tuples and keys as they were."""
    return json.loads(field, object_hook=_from_json_object)


class ReasoningGym(Task):
    """One reasoning-gym dataset, named by `get_task("reasoning_gym:<dataset>")`."""

    param_fields = ("task_config",)

    def __init__(self, dataset: str) -> None:
        self.name = f"{PREFIX}:{dataset}"
        self.dataset = dataset
        rg = _reasoning_gym(self.name)
        if dataset not in rg.factory.DATASETS:
            valid = ", ".join(f"{PREFIX}:{n}" for n in sorted(rg.factory.DATASETS))
            problem = (
                f"{self.name!r}: reasoning-gym {version('reasoning-gym')} has no dataset {dataset!r}"
                if dataset
                else f"{PREFIX!r} needs a dataset, {PREFIX}:<dataset>"
            )
            raise ValueError(f"data.task={problem}; valid: {valid}")
        self._rg = rg
        self._scorers: dict[str, Any] = {}  # config JSON -> dataset, for score_answer

    def check(self, cfg: DataConfig) -> None:
        """data.task_config's keys are the dataset's config fields (size and seed aside) and
        its values make a dataset that makes an entry; ValueError naming data.task_config."""
        config_class = self._rg.factory.DATASETS[self.dataset][1]
        valid = [f.name for f in dataclasses.fields(config_class) if f.name not in _SET_ELSEWHERE]
        for key in cfg.task_config:
            if key in _SET_ELSEWHERE:
                raise ValueError(
                    f"data.task_config.{key}: set by {_SET_ELSEWHERE[key]} for data.task="
                    f"{self.name}, not in data.task_config"
                )
            if key not in valid:
                raise ValueError(
                    f"data.task_config: unknown key {key!r} for data.task={self.name}; valid: "
                    f"{', '.join(valid)}"
                )
        dataset = self._create(cfg.task_config, size=1, seed=0)
        try:
            dataset[0]
        except Exception as exc:  # some configs fail only when an entry is made
            raise ValueError(
                f"data.task_config {cfg.task_config} of data.task={self.name} makes no entry: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def _create(self, config: dict, size: int, seed: int) -> Any:
        try:
            return self._rg.create_dataset(self.dataset, size=size, seed=seed, **config)
        except (AssertionError, TypeError, ValueError) as exc:  # the configs' validate() asserts
            raise ValueError(
                f"data.task_config {config} is not a valid config of reasoning-gym dataset "
                f"{self.dataset!r}: {exc or type(exc).__name__}"
            ) from None

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        self.check(cfg)
        # reasoning-gym seeds entry i with seed + i; numpy-seeded datasets need it below 2**32.
        dataset = self._create(cfg.task_config, size=num, seed=rng.randrange(2**31))
        examples = []
        for index in range(num):
            entry = dataset[index]
            answer = entry.get("answer")
            examples.append(
                {
                    "prompt": entry["question"],
                    "answer": "" if answer is None else str(answer),
                    PREFIX: encode(self.dataset, cfg.task_config, entry),
                }
            )
        return examples

    def score(self, response: str, example: dict) -> float:
        """The dataset's `score_answer` of the response (its last <answer>...</answer> when it
        has one, else the whole response, surrounding whitespace stripped), in [0, 1]; 0.0 when
        the scorer raises or returns something else. An example not made by this task raises
        ValueError: a data bug must show up, not score 0 for every response."""
        field = example.get(PREFIX)
        try:
            saved = decode(field)
            dataset, config, entry = saved["dataset"], saved["config"], saved["entry"]
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{self.name} example has no readable {PREFIX!r} field ({exc}): it was not made "
                f"by data.task={self.name}"
            ) from None
        if dataset != self.dataset:
            raise ValueError(f"{self.name} cannot score an example of reasoning_gym:{dataset}")
        if not isinstance(response, str):
            return 0.0
        answer = self._rg.utils.extract_answer(response)
        answer = response.strip() if answer is None else answer
        try:
            reward = float(self._scorer(config).score_answer(answer, entry))
        except Exception:  # the dataset's parser on junk: any error is a wrong answer
            return 0.0
        return min(1.0, max(0.0, reward)) if math.isfinite(reward) else 0.0

    def _scorer(self, config: dict) -> Any:
        key = json.dumps(config, sort_keys=True)
        if key not in self._scorers:
            self._scorers[key] = self._create(config, size=1, seed=0)
        return self._scorers[key]


TASKS.register(PREFIX, family=True)(ReasoningGym)
