"""The built-in tools, by name (`ToolPool(tools=["python"])`). Like every tool they run only
in a `ToolPool` worker's per-call process, under its limits."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable

from rl.config.registry import NoTraits, Registry

BUILTIN_TOOLS: Registry[Callable, NoTraits] = Registry("built-in tool")


@BUILTIN_TOOLS.register("python")
def python(code: str) -> str | None:
    """Run Python code; returns what it prints and the value of its last expression.

    Each call starts from a fresh namespace in an empty working directory, with no network.

    Args:
        code: Python source code, one or more statements.
    """
    tree = ast.parse(code, filename="<code>")
    # Like the REPL, a trailing expression's value is shown; it is evaluated after the rest.
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(tree, "<code>", "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
    return None if value is None else repr(value)
