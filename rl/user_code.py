"""Objects a user names as `path/to/file.py:name`: reward functions (rl.rewards.terms), agent
environments (rl.agents.env_pool) and tools (rl.agents.tools).

The driver only reads such a file (`check_file_object`: it exists, parses and binds the name
at top level); it is imported (`load_file_object`) only in a sandboxed worker process
(rl.sandbox), which runs the user's code under limits.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path


def parse_file_ref(ref: str, what: str) -> tuple[str, str] | None:
    """(path, name) of `path/to/file.py:name`; None when `ref` is not of that form.
    ValueError, naming `what`, for a `.py` path without a valid name."""
    path, sep, name = ref.rpartition(":")
    if sep and path.endswith(".py"):
        if not name.isidentifier():
            raise ValueError(
                f"{what}: {name!r} is not a Python name (expected 'path/to/file.py:name')"
            )
        return path, name
    if ref.endswith(".py"):
        raise ValueError(f"{what}: name the object too, as 'path/to/file.py:name'")
    return None


def _existing(what: str, path: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"{what}: file {path!r} not found "
            f"(relative paths start at the working directory {os.getcwd()})"
        )
    return file


def check_file_object(what: str, path: str, name: str) -> None:
    """Without running it: the Python file `path` exists, parses, and binds `name` at top
    level. ValueError naming `what` and what is wrong."""
    file = _existing(what, path)
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"{what}: {str(file)!r} does not parse: {e}") from None
    if name not in _top_level_names(tree):
        raise ValueError(f"{what}: {str(file)!r} defines no {name!r} at top level")


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


def load_file_object(what: str, path: str, name: str) -> object:
    """`name` from the Python file `path`, imported by path; ValueError naming `what` and what
    is wrong. Runs the file's code: call it only in a sandboxed worker."""
    file = _existing(what, path).resolve()
    # A unique module name per file: two users' `reward.py` must not replace each other, and
    # registering it in sys.modules lets dataclasses and pickling inside the file work.
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", file.stem)
    module_name = f"tandem_user_{stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"{what}: {str(file)!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ValueError(
                f"{what}: importing {str(file)!r} failed: {type(e).__name__}: {e}"
            ) from e
    if not hasattr(module, name):
        raise ValueError(f"{what}: {str(file)!r} defines no {name!r}")
    return getattr(module, name)
