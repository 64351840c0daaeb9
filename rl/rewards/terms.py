"""Reward term names: parsing, validation, and loading the functions they name.

A term is `task` (the data task's scorer), a `VERIFIERS` name, `path/to/file.py:function`
(a user's function, the path relative to the working directory or absolute) or `model:PATH`
(an HF sequence-classification checkpoint). Function terms travel to the reward worker
processes as `FunctionTerm` values and are loaded there again.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rl.config import RewardConfig
from rl.data.tasks import Task
from rl.rewards.verifiers import VERIFIERS

RewardFn = Callable[[str, dict], float]
TermKind = Literal["task", "verifier", "file", "model"]
MODEL_PREFIX = "model:"


def _term_forms() -> str:
    return (
        f"'task', a verifier ({', '.join(VERIFIERS.names())}), "
        "'path/to/file.py:function' or 'model:PATH'"
    )


def parse_term(name: str) -> tuple[TermKind, str]:
    """(kind, argument) of a term name: the verifier name, `path:function` or the model path."""
    if name == "task":
        return "task", ""
    if name.startswith(MODEL_PREFIX):
        path = name[len(MODEL_PREFIX) :]
        if not path:
            raise ValueError(f"reward term {name!r}: no checkpoint path after 'model:'")
        return "model", path
    file, sep, function = name.rpartition(":")
    if sep and file.endswith(".py"):
        if not function.isidentifier():
            raise ValueError(
                f"reward term {name!r}: {function!r} is not a function name "
                "(expected 'path/to/file.py:function')"
            )
        return "file", name
    if name.endswith(".py"):
        raise ValueError(
            f"reward term {name!r}: name the function too, as 'path/to/file.py:function'"
        )
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


def check_user_function(term: str, path: str, function: str) -> None:
    """Without running it: the Python file `path` exists, parses, and binds `function` at
    top level. ValueError naming what is wrong. User code runs only in reward workers
    (rl.rewards.pool), which import it with a timeout, limits and a clean environment."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"reward term {term!r}: file {path!r} not found "
            f"(relative paths start at the working directory {os.getcwd()})"
        )
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"reward term {term!r}: {str(file)!r} does not parse: {e}") from None
    if function not in _top_level_names(tree):
        raise ValueError(f"reward term {term!r}: {str(file)!r} has no function {function!r}")


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at top level: defs, classes, assignments and imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def load_user_function(term: str, path: str, function: str) -> RewardFn:
    """`function` from the Python file `path`, imported by path; ValueError naming what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"reward term {term!r}: file {path!r} not found "
            f"(relative paths start at the working directory {os.getcwd()})"
        )
    file = file.resolve()
    # A unique module name per file: two users' `reward.py` must not replace each other, and
    # registering it in sys.modules lets dataclasses and pickling inside the file work.
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", file.stem)
    module_name = f"tandem_reward_{stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"reward term {term!r}: {str(file)!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ValueError(
                f"reward term {term!r}: importing {str(file)!r} failed: {type(e).__name__}: {e}"
            ) from e
    fn = getattr(module, function, None)
    if fn is None:
        raise ValueError(f"reward term {term!r}: {str(file)!r} has no function {function!r}")
    if not callable(fn):
        raise ValueError(
            f"reward term {term!r}: {function!r} in {str(file)!r} is not callable "
            f"(it is a {type(fn).__name__})"
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
            check_user_function(name, path, function)  # statically: it is imported by workers
            return cls(name, "file", path=os.path.abspath(path), function=function)
        raise ValueError(f"reward term {name!r} is a reward model, not a function")

    def load(self) -> RewardFn:
        """The callable `fn(response, example) -> float` this term names."""
        if self.kind == "task":
            assert self.task is not None
            return self.task.score
        if self.kind == "verifier":
            return VERIFIERS.get(self.name)
        return load_user_function(self.name, self.path, self.function)


def check_reward_terms(cfg: RewardConfig) -> None:
    """Validate `cfg` without starting anything; ValueError naming the bad term or field.

    User files are read, never imported here: they must parse and define their function at
    top level (their code runs only in the reward workers); model paths must be checkpoint
    directories.
    """
    if not cfg.terms:
        raise ValueError(f"reward.terms is empty; a term is {_term_forms()}")
    for term in cfg.terms:
        if not math.isfinite(term.weight):
            raise ValueError(f"reward term {term.name!r}: weight {term.weight} is not finite")
        kind, arg = parse_term(term.name)
        if kind == "file":
            path, _, function = arg.rpartition(":")
            check_user_function(term.name, path, function)
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
