"""Reward term names: parsing, validation, and loading the functions they name.

A term is `task` (the data task's scorer), a `VERIFIERS` name, `path/to/file.py:function`
(a user's function, the path relative to the working directory or absolute), `model:PATH`
(an HF sequence-classification checkpoint) or `judge` (a generative judge, configured in the
term's `judge` section: rl.rewards.judge). Function terms travel to the reward worker
processes as `FunctionTerm` values and are loaded there again.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rl.config import RewardConfig
from rl.data.tasks import Task, get_task
from rl.rewards.verifiers import VERIFIERS
from rl.user_code import check_file_object, load_file_object, parse_file_ref

RewardFn = Callable[[str, dict], float]
TermKind = Literal["task", "verifier", "file", "model", "judge"]
MODEL_PREFIX = "model:"
JUDGE = "judge"


def _term_forms() -> str:
    return (
        f"'task', a verifier ({', '.join(VERIFIERS.names())}), "
        "'path/to/file.py:function', 'model:PATH' or 'judge'"
    )


def parse_term(name: str) -> tuple[TermKind, str]:
    """(kind, argument) of a term name: the verifier name, `path:function` or the model path."""
    if name == "task":
        return "task", ""
    if name == JUDGE:
        return "judge", ""
    if name.startswith(MODEL_PREFIX):
        path = name[len(MODEL_PREFIX) :]
        if not path:
            raise ValueError(f"reward term {name!r}: no checkpoint path after 'model:'")
        return "model", path
    if parse_file_ref(name, f"reward term {name!r}") is not None:
        return "file", name
    if name not in VERIFIERS:
        raise ValueError(f"reward term {name!r}: unknown verifier {name!r}; valid: {_term_forms()}")
    return "verifier", name


def term_label(name: str) -> str:
    """A short metric-safe label: `task`, the verifier or function name, `model_<dir name>`."""
    kind, arg = parse_term(name)
    if kind == "file":
        label = arg.rpartition(":")[2]
    elif kind == "model":
        label = "model_" + Path(arg.rstrip("/\\")).name
    else:
        label = name
    return re.sub(r"[^A-Za-z0-9_]+", "_", label).strip("_") or "term"


def load_user_function(term: str, path: str, function: str) -> RewardFn:
    """`function` from the Python file `path` (rl.user_code.load_file_object): only in a
    reward worker. ValueError naming what is wrong."""
    what = f"reward term {term!r}"
    fn = load_file_object(what, path, function)
    if not callable(fn):
        raise ValueError(
            f"{what}: {function!r} in {path!r} is not callable (it is a {type(fn).__name__})"
        )
    return fn


@dataclass(frozen=True)
class FunctionTerm:
    """A function reward term described by value, so that any process can load it."""

    name: str
    kind: Literal["task", "verifier", "file"]
    task: Task | None = None  # the data task, for kind "task"
    path: str = ""  # absolute file path, for kind "file"
    function: str = ""  # function name, for kind "file"

    @classmethod
    def from_name(cls, name: str, task: Task) -> FunctionTerm:
        """The term `name` (not a model term); ValueError when it names nothing loadable."""
        kind, arg = parse_term(name)
        if kind == "task":
            return cls(name, "task", task=task)
        if kind == "verifier":
            return cls(name, "verifier")
        if kind == "file":
            path, _, function = arg.rpartition(":")
            check_file_object(
                f"reward term {name!r}", path, function
            )  # statically: it is imported by workers
            return cls(name, "file", path=os.path.abspath(path), function=function)
        raise ValueError(f"reward term {name!r} is a reward model or a judge, not a function")

    def to_json(self) -> dict:
        """The term as JSON, for a reward worker (which never unpickles what crosses to it)."""
        task = None if self.task is None else self.task.name
        return {
            "name": self.name,
            "kind": self.kind,
            "task": task,
            "path": self.path,
            "function": self.function,
        }

    @classmethod
    def from_json(cls, data: dict) -> FunctionTerm:
        task = None if data["task"] is None else get_task(data["task"])
        return cls(data["name"], data["kind"], task, data["path"], data["function"])

    def load(self) -> RewardFn:
        """The callable `fn(response, example) -> float` this term names."""
        if self.kind == "task":
            assert self.task is not None
            return self.task.score
        if self.kind == "verifier":
            return VERIFIERS.get(self.name)
        return load_user_function(self.name, self.path, self.function)


def check_reward_terms(cfg: RewardConfig, will_exist: Collection[str] = ()) -> None:
    """Validate `cfg` without starting anything; ValueError naming the bad term or field.

    User files are read, never imported here: they must parse and define their function at
    top level (their code runs only in the reward workers); model paths must be checkpoint
    directories, except a judge's whose absolute path is in `will_exist` (a base the run
    builds before it starts the judge); a judge's template must parse, and the environment
    variable of its API key must be set (rl.rewards.judge.check_judge).
    """
    from rl.rewards.judge import check_judge

    if not cfg.terms:
        raise ValueError(f"reward.terms is empty; a term is {_term_forms()}")
    for index, term in enumerate(cfg.terms):
        if not math.isfinite(term.weight):
            raise ValueError(f"reward term {term.name!r}: weight {term.weight} is not finite")
        kind, arg = parse_term(term.name)
        if (kind == "judge") != (term.judge is not None):
            raise ValueError(
                f"reward.terms[{index}] ({term.name!r}): a term named 'judge' has a judge "
                "section, and only such a term"
            )
        if term.judge is not None:
            check_judge(index, term.judge, will_exist)
        elif kind == "file":
            path, _, function = arg.rpartition(":")
            check_file_object(f"reward term {term.name!r}", path, function)
        elif kind == "model" and not (Path(arg) / "config.json").is_file():
            raise ValueError(
                f"reward term {term.name!r}: {arg!r} is not an HF checkpoint directory "
                "(no config.json there)"
            )
    if cfg.timeout_s <= 0:
        raise ValueError(f"reward.timeout_s must be > 0, got {cfg.timeout_s}")
    if cfg.num_processes < 1:
        raise ValueError(f"reward.num_processes must be >= 1, got {cfg.num_processes}")
    if cfg.model_batch_size < 1:
        raise ValueError(f"reward.model_batch_size must be >= 1, got {cfg.model_batch_size}")
