"""Tool calls parsed from a model's output, in its family's own format, and checked against the
tools' JSON schemas.

A parser (registered in `TOOL_CALL_FORMATS`) only reads the syntax of its format; the checks
against the tools (known name, arguments matching the schema) are the same for every format.
Every problem becomes a `ToolCallError` the environment shows back to the model
(`error_observation`) and counts by its kind, rather than an exception: a policy in training
writes broken calls, and learns from reading why.

Tools are given as the function schemas chat templates take (OpenAI / Hugging Face style):
`{"name", "description", "parameters": {"type": "object", "properties", "required"}}`, bare or
wrapped as `{"type": "function", "function": {...}}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rl.config.registry import Registry

# "malformed": the call cannot be read (bad JSON, missing keys, unclosed tag);
# "unknown_tool": its name is not among the tools; "bad_arguments": they break the schema.
ErrorKind = Literal["malformed", "unknown_tool", "bad_arguments"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    kind: ErrorKind
    message: str  # what is wrong, in words the model can act on


@dataclass(frozen=True)
class ToolCallFormat:
    """The traits of a tool-call format."""

    example: str  # how one call is written, shown to the model after a malformed one
    block: re.Pattern  # one call's whole text, closing tag included (removed from a reply)


Parser = Callable[[str], list[ToolCall | ToolCallError]]
TOOL_CALL_FORMATS: Registry[Parser, ToolCallFormat] = Registry("tool-call format", ToolCallFormat)

# Longest excerpt of the model's own text quoted back in an error.
_QUOTE_CHARS = 60


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@TOOL_CALL_FORMATS.register(
    "hermes",
    example='<tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\n</tool_call>',
    block=_HERMES_BLOCK,
)
def parse_hermes(text: str) -> list[ToolCall | ToolCallError]:
    """Hermes / Qwen2.5 calls: each a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    block, anywhere in the text, in order. Text outside the blocks is the model's to write."""
    found: list[ToolCall | ToolCallError] = []
    for match in _HERMES_BLOCK.finditer(text):
        body, closing = match.group(1), match.group(2)
        if not closing:
            found.append(ToolCallError("malformed", f"<tool_call> {_quote(body)} is never closed"))
            continue
        found.append(_call_from_json(body))
    return found


def _call_from_json(body: str) -> ToolCall | ToolCallError:
    """A call from the JSON object `{"name": str, "arguments": object}` in `body`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError("malformed", f"tool call {_quote(body)} is not valid JSON ({e})")
    if not isinstance(obj, dict):
        return ToolCallError("malformed", f"tool call {_quote(body)} is not a JSON object")
    missing = [key for key in ("name", "arguments") if key not in obj]
    if missing:
        return ToolCallError(
            "malformed", f"tool call {_quote(body)} has no {' and no '.join(map(repr, missing))}"
        )
    if not isinstance(obj["name"], str):
        return ToolCallError("malformed", f"tool call name {obj['name']!r} is not a string")
    if not isinstance(obj["arguments"], dict):
        return ToolCallError(
            "malformed", f"arguments of {obj['name']!r} are not a JSON object: {obj['arguments']!r}"
        )
    return ToolCall(obj["name"], obj["arguments"])


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]], format_name: str = "hermes"
) -> list[ToolCall | ToolCallError]:
    """The calls in `text` (the assistant's output) in order, each a `ToolCall` to run or a
    `ToolCallError` to show back, checked against `tools` (function schemas)."""
    schemas = {}
    for tool in tools:
        schema = tool.get("function", tool)  # the OpenAI wrapper or the bare function schema
        schemas[schema["name"]] = schema
    return [
        _check(item, schemas) if isinstance(item, ToolCall) else item
        for item in TOOL_CALL_FORMATS.get(format_name)(text)
    ]


def _check(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> ToolCall | ToolCallError:
    if call.name not in schemas:
        return ToolCallError(
            "unknown_tool",
            f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(schemas)) or 'none'}",
        )
    parameters = schemas[call.name].get("parameters", {"type": "object", "properties": {}})
    problems = _schema_problems(call.arguments, parameters, "arguments", call.name)
    if problems:
        return ToolCallError(
            "bad_arguments", f"bad arguments for {call.name}: {'; '.join(problems)}"
        )
    return call


def error_observation(error: ToolCallError, format_name: str = "hermes") -> str:
    """What the model reads after a call that failed: the problem, and for a call it could not
    read, how a call is written."""
    text = f"Error: {error.message}."
    if error.kind == "malformed":
        text += f" Write each call as:\n{TOOL_CALL_FORMATS.traits(format_name).example}"
    return text


# JSON schema's type names; bool is checked apart, being an int in Python.
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next(name for name, t in _JSON_TYPES.items() if isinstance(value, t))


def _has_type(value: Any, name: str, tool: str) -> bool:
    if name not in _JSON_TYPES:
        raise ValueError(
            f"tool {tool!r}: unknown JSON schema type {name!r}; valid: {', '.join(_JSON_TYPES)}"
        )
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer" and isinstance(value, float):
        return value.is_integer()  # JSON has one number type: 2.0 is an integer
    return isinstance(value, _JSON_TYPES[name])


def _schema_problems(value: Any, schema: dict[str, Any], path: str, tool: str) -> list[str]:
    """What in `value` breaks `schema` (the subset function schemas use: type, enum, and an
    object's properties / required / additionalProperties, an array's items), each naming its
    path. An object takes no key outside its properties unless additionalProperties allows."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_has_type(value, t, tool) for t in types):
            return [f"{path} should be {' or '.join(types)}, not {_json_type(value)} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path} is {value!r}, not one of {', '.join(map(repr, schema['enum']))}"]
    problems = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        problems += [
            f"missing required {path}.{key}"
            for key in schema.get("required", [])
            if key not in value
        ]
        for key, item in value.items():
            if key in properties:
                problems += _schema_problems(item, properties[key], f"{path}.{key}", tool)
            elif not schema.get("additionalProperties", False):
                problems.append(f"unexpected {path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += _schema_problems(item, schema["items"], f"{path}[{i}]", tool)
    return problems
