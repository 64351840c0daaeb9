"""Tool schemas from type hints and docstrings, argument checks against them, naming tools,
and the built-in python tool's semantics (run here: it is this repo's code)."""

from __future__ import annotations

import copy
import urllib.request
from pathlib import Path
from typing import Literal

import pytest
from referencing.exceptions import Unresolvable

from rl.agents.builtin_tools import python
from rl.agents.tools import (
    ToolSpec,
    check_arguments,
    check_schema,
    resolve_tool,
    tool_schema,
)
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
        ({"xs": [], "title": 3}, "argument 'title': expected string or null, got integer"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments: object, problem: str | None) -> None:
    assert check_arguments(tool_schema(plot), arguments) == problem


def lookup(
    key: int | list[str],
    weights: dict[str, float],
    point: tuple[int, str],
    mode: Literal["fast", "exact"] | None,
    limit: int,
) -> str:
    """Look a key up.

    Args:
        key: A number or some names.
        weights: A weight per name.
        point: A position and a label.
        mode: How to look, if it matters.
        limit: At most this many results.
    """
    return ""


VALID = {"key": 1, "weights": {}, "point": [0, "a"], "mode": None, "limit": 1}
# Hand-written, as a schema need not come from type hints: bounds and a nested object.
BOUNDED = {
    "type": "function",
    "function": {
        "name": "bounded",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 1},
                "opts": {
                    "type": "object",
                    "properties": {"depth": {"type": "integer"}},
                    "required": ["depth"],
                },
            },
        },
    },
}


# What JSON Schema (draft 2020-12) says of each, read from the specification: anyOf needs one
# branch to hold, additionalProperties and prefixItems constrain a map's values and a tuple's
# items, a number with a zero fraction is an integer, transformers' `nullable` admits null.
@pytest.mark.parametrize(
    "schema, arguments, problem",
    [
        (tool_schema(lookup), VALID, None),
        (tool_schema(lookup), {**VALID, "key": ["a", "b"], "mode": "fast"}, None),
        (tool_schema(lookup), {**VALID, "limit": 5.0}, None),
        (
            tool_schema(lookup),
            {**VALID, "key": "a"},
            "argument 'key': expected integer or array, got string",
        ),
        (
            tool_schema(lookup),
            {**VALID, "key": ["a", 1]},
            "argument 'key': item 1: expected string, got integer",
        ),
        (
            tool_schema(lookup),
            {**VALID, "weights": {"a": "heavy"}},
            "argument 'weights': key 'a': expected number, got string",
        ),
        (
            tool_schema(lookup),
            {**VALID, "point": ["a", "b"]},
            "argument 'point': item 0: expected integer, got string",
        ),
        (
            tool_schema(lookup),
            {**VALID, "mode": "slow"},
            "argument 'mode': 'slow' is not one of ['fast', 'exact', None]",
        ),
        (
            tool_schema(lookup),
            {**VALID, "limit": 2.5},
            "argument 'limit': expected integer, got number",
        ),
        (BOUNDED, {"n": 1, "opts": {"depth": 2}}, None),
        (BOUNDED, {"n": 0}, "argument 'n': 0 is less than the minimum of 1"),
        (BOUNDED, {"opts": {}}, "argument 'opts': 'depth' is a required property"),
        (
            BOUNDED,
            {"opts": {"depth": "deep"}},
            "argument 'opts': key 'depth': expected integer, got string",
        ),
    ],
)
def test_arguments_are_judged_as_json_schema_says(
    schema: dict, arguments: dict, problem: str | None
) -> None:
    assert check_arguments(schema, arguments) == problem


def test_a_workers_schema_must_be_valid_json_schema_without_refs() -> None:
    assert check_schema("plot", tool_schema(plot)) == tool_schema(plot)  # `nullable` included
    misspelt = copy.deepcopy(BOUNDED)
    misspelt["function"]["parameters"]["properties"]["n"]["type"] = "integr"
    with pytest.raises(RuntimeError, match="malformed schema for tool 'bounded': 'integr' is not"):
        check_schema("bounded", misspelt)
    remote = copy.deepcopy(BOUNDED)
    remote["function"]["parameters"]["properties"]["n"] = {"$ref": "https://example.com/n"}
    with pytest.raises(RuntimeError, match="malformed schema for tool 'bounded'"):
        check_schema("bounded", remote)


def test_a_ref_in_a_schema_is_never_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **kw: fetched.append(a))
    remote = copy.deepcopy(BOUNDED)
    remote["function"]["parameters"]["properties"]["n"] = {"$ref": "https://example.com/n"}
    with pytest.raises(Unresolvable):
        check_arguments(remote, {"n": 1})
    assert fetched == []


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
