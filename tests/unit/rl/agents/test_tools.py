"""Tool schemas from type hints and docstrings, argument checks against them, naming tools,
and the built-in python tool's semantics (run here: it is this repo's code)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from rl.agents.builtin_tools import python
from rl.agents.tools import ToolSpec, check_arguments, resolve_tool, tool_schema
from tests.helpers.repo import REPO
from tests.unit.rl.agents import sample_tools


def search(query: str, limit: int = 5, fuzzy: bool = False) -> list:
    """Search the notes.

    Matches are ranked by how many words they share with the query.

    Args:
        query: Words to look for.
        limit: At most this many results.
        fuzzy: Also match misspellings.
    """
    return []


def plot(xs: list[float], style: Literal["line", "bar"] = "line", title: str | None = None) -> str:
    """Draw a chart
    of the values.

    Args:
        xs: The values.
        style: How to draw them.
        title: A title, if any.
    """
    return ""


def test_schemas_from_type_hints_and_docstrings() -> None:
    assert tool_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Words to look for."},
                    "limit": {"type": "integer", "description": "At most this many results."},
                    "fuzzy": {"type": "boolean", "description": "Also match misspellings."},
                },
                "required": ["query"],
            },
            "return": {"type": "array"},
        },
    }
    assert tool_schema(plot) == {
        "type": "function",
        "function": {
            "name": "plot",
            "description": "Draw a chart of the values.",
            "parameters": {
                "type": "object",
                "properties": {
                    "xs": {
                        "type": "array",
                        "items": {"type": "number"},
                        "description": "The values.",
                    },
                    "style": {
                        "type": "string",
                        "enum": ["line", "bar"],
                        "description": "How to draw them.",
                    },
                    "title": {
                        "type": "string",
                        "nullable": True,
                        "description": "A title, if any.",
                    },
                },
                "required": ["xs"],
            },
            "return": {"type": "string"},
        },
    }
    assert tool_schema(python)["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source code, one or more statements."}
        },
        "required": ["code"],
    }


def test_a_parameter_without_a_description_or_a_type_is_refused() -> None:
    def undocumented(x: int) -> int:
        """No Args section."""
        return x

    with pytest.raises(
        ValueError, match="tool 'undocumented': .*no description for the argument 'x'"
    ):
        tool_schema(undocumented)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"xs": [1, 2.5]}, None),
        ({"xs": [], "style": "bar", "title": None}, None),
        ([1], "the arguments must be a JSON object, not array"),
        ({"style": "bar"}, "missing argument(s) 'xs'"),
        (
            {"xs": [], "color": "red"},
            "unexpected argument(s) 'color' (expected: 'xs', 'style', 'title')",
        ),
        ({"xs": "1,2"}, "argument 'xs': expected array, got string"),
        ({"xs": [1, True]}, "argument 'xs': item 1: expected number, got boolean"),
        ({"xs": [], "style": "pie"}, "argument 'style': 'pie' is not one of ['line', 'bar']"),
        ({"xs": [], "title": 3}, "argument 'title': expected string, got integer"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments: object, problem: str | None) -> None:
    assert check_arguments(tool_schema(plot), arguments) == problem


def test_a_tool_is_named_by_its_module_and_imported_from_its_root() -> None:
    spec = resolve_tool(sample_tools.nap)
    assert (spec.name, spec.spec) == ("nap", "tests.unit.rl.agents.sample_tools:nap")
    assert spec.root == str(REPO)
    assert resolve_tool("python").spec == "rl.agents.builtin_tools:python"


def test_a_users_tool_file_is_read_not_imported_by_the_driver(tmp_path: Path) -> None:
    imported = tmp_path / "imported"
    tool_file = tmp_path / "my_tools.py"
    tool_file.write_text(
        f"open({str(imported)!r}, 'w').close()\ndef lookup(key: str) -> str: ...\n"
    )
    spec = resolve_tool(f"{tool_file}:lookup")
    assert spec == ToolSpec("lookup", f"{tool_file}:lookup", "", None)  # its schema: a worker's
    assert not imported.exists()
    with pytest.raises(ValueError, match=r"my_tools\.py' defines no 'other' at top level"):
        resolve_tool(f"{tool_file}:other")


def test_the_python_tool_shows_the_last_expression_like_the_repl() -> None:
    assert python("x = [1, 2]\nx + [3]") == "[1, 2, 3]"
    assert python("'a' * 2") == "'aa'"
    assert python("x = 1") is None
    assert python("None") is None
    assert python("") is None
    with pytest.raises(ZeroDivisionError):
        python("y = 1\ny / 0")
    with pytest.raises(NameError):
        python("x")  # each call starts from a fresh namespace
