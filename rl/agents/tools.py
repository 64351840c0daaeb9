"""Tools as typed Python functions: their schema for the chat template, checking a call's
arguments against it, and naming a tool so that a worker process can import it.

A tool is a function defined at the top level of an importable module, with a type hint and
a docstring line (Google style, under `Args:`) for each parameter, and returning a str, int,
float, bool, None, list or dict. A user's tool is named `path/to/file.py:function`: the driver
only reads that file (rl.user_code); a `ToolPool` worker imports it, reads its schema and runs
its calls. A built-in tool is named by its `BUILTIN_TOOLS` name.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing import Registry
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import (
    DocstringParsingException,
    TypeHintParsingException,
)

from rl.agents.builtin_tools import BUILTIN_TOOLS
from rl.user_code import check_file_object, parse_file_ref


@dataclass(frozen=True)
class ToolSpec:
    """A tool as a worker process finds it: `spec` is "module:function" (`root` the directory
    that `module` is imported from) or "/absolute/path/file.py:function" (`root` empty).
    `schema` is what `tool_schema` gives; None for a user's file, whose schema only a worker
    can read."""

    name: str
    spec: str
    root: str
    schema: dict | None


def tool_schema(fn: Callable) -> dict:
    """The function schema of `fn`, in the form that HF `apply_chat_template(tools=...)` and
    OpenAI-style APIs take: {"type": "function", "function": {"name", "description",
    "parameters": JSON schema from the type hints}}. The description is the docstring's first
    paragraph, the parameters' descriptions come from its `Args:` section."""
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ValueError(f"tool {fn.__name__!r}: {e}") from None
    # HF keeps every paragraph before `Args:`; the model's prompt needs only the summary.
    first = schema["function"]["description"].split("\n\n")[0]
    schema["function"]["description"] = " ".join(first.split())
    return schema


def resolve_tool(tool: str | Callable) -> ToolSpec:
    """A tool given as a built-in name ("python"), a user's `path/to/file.py:function` (read,
    not imported) or a function defined at the top level of an importable module (a caller's
    own, already imported). ValueError naming what is wrong."""
    if isinstance(tool, str):
        ref = parse_file_ref(tool, f"tool {tool!r}")
        if ref is not None:
            path, name = ref
            check_file_object(f"tool {tool!r}", path, name)
            return ToolSpec(name, f"{os.path.abspath(path)}:{name}", "", None)
        if tool not in BUILTIN_TOOLS:
            raise ValueError(
                f"tool {tool!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS.names())}) "
                "nor 'path/to/file.py:function'"
            )
        fn = BUILTIN_TOOLS.get(tool)
    else:
        fn = tool
    if not callable(fn):
        raise ValueError(f"tool {tool!r} is a {type(fn).__name__}, not a function")
    module = sys.modules.get(fn.__module__)
    if module is None or fn.__module__ == "__main__" or "<" in fn.__qualname__:
        # A worker imports the tool by name: a lambda, a nested function or a script's own
        # function has no name it could import.
        raise ValueError(
            f"tool {fn.__qualname__!r} of module {fn.__module__!r}: define it at the top level "
            "of an importable module"
        )
    spec = f"{fn.__module__}:{fn.__qualname__}"
    return ToolSpec(fn.__name__, spec, _import_root(module), tool_schema(fn))


def check_schema(name: str, schema: object) -> dict:
    """`schema` if it has the shape `tool_schema` gives for a tool called `name` (it came
    from a worker process, which ran a user's file) and its parameters are a valid JSON
    Schema (draft 2020-12) without `$ref`s, which transformers never writes and which could
    point anywhere; RuntimeError otherwise."""
    function = schema.get("function") if isinstance(schema, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    if not (
        isinstance(parameters, dict)
        and schema.get("type") == "function"
        and function.get("name") == name
        and isinstance(function.get("description", ""), str)
        and isinstance(parameters.get("properties"), dict)
        and all(isinstance(p, dict) for p in parameters["properties"].values())
        and isinstance(parameters.get("required", []), list)
        and not _has_ref(parameters)
    ):
        raise RuntimeError(f"a tool worker sent a malformed schema for tool {name!r}")
    try:
        Draft202012Validator.check_schema(_with_null(parameters))
    except SchemaError as e:
        raise RuntimeError(
            f"a tool worker sent a malformed schema for tool {name!r}: {e.message}"
        ) from None
    return schema


def _has_ref(schema: object) -> bool:
    if isinstance(schema, dict):
        return any(k in ("$ref", "$dynamicRef") or _has_ref(v) for k, v in schema.items())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _import_root(module: object) -> str:
    """The directory that `module` is imported from (its top-level package's parent)."""
    path = Path(module.__file__).resolve()
    depth = module.__name__.count(".") + (path.name == "__init__.py")
    return str(path.parents[depth])


def check_arguments(schema: dict, arguments: object) -> str | None:
    """Why `arguments` do not fit the function schema `schema` (`tool_schema`'s form), or None
    when they do: a JSON object with every required parameter and no other (a function takes
    no other keyword, though the schema does not say so), valid under the parameters' JSON
    Schema as the `jsonschema` library judges it (draft 2020-12; transformers' `nullable`
    read as "or null"). The problem is worded for the model: the argument and the place in it,
    then what was expected."""
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, not {_json_type(arguments)}"
    parameters = schema["function"]["parameters"]
    properties = parameters["properties"]
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(map(repr, missing))}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        expected = ", ".join(map(repr, properties)) or "none"
        return f"unexpected argument(s) {', '.join(map(repr, unknown))} (expected: {expected})"
    # An empty registry: a `$ref` is never fetched (jsonschema's default would fetch a URL).
    validator = Draft202012Validator(_with_null(parameters), registry=Registry())
    error = best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = [
        f"argument {key!r}" if i == 0 else f"item {key}" if isinstance(key, int) else f"key {key!r}"
        for i, key in enumerate(error.absolute_path)
    ]
    return ": ".join([*where, _problem(error)])


def _problem(error: ValidationError) -> str:
    """What is wrong with `error.instance`, with JSON's type names where a type is wrong."""
    got = _json_type(error.instance)
    if error.validator == "type":
        types = error.validator_value
        types = [types] if isinstance(types, str) else types
        return f"expected {' or '.join(types)}, got {got}"
    if error.validator in ("anyOf", "oneOf"):
        types = [s.get("type") for s in error.validator_value if isinstance(s, dict)]
        if all(isinstance(t, str) for t in types) and got not in types:
            return f"expected {' or '.join(types)}, got {got}"
    return error.message


# Where a JSON Schema holds other schemas: one, a list of them, or a map of names to them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")


def _with_null(schema: object) -> object:
    """`schema` with transformers' (OpenAPI's) `"nullable": true` written as JSON Schema says
    it: "null" among the types and None among the `enum` values."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k != "nullable"}
    for k in _SUBSCHEMA:
        if k in out:
            out[k] = _with_null(out[k])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_with_null(s) for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _with_null(s) for name, s in out[k].items()}
    if schema.get("nullable") is True:
        if "type" in out:
            types = [out["type"]] if isinstance(out["type"], str) else list(out["type"])
            out["type"] = [*types, "null"]
        if isinstance(out.get("enum"), list):
            out["enum"] = [*out["enum"], None]
    return out


_JSON_TYPES = (
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
    (type(None), "null"),
)


def _json_type(value: object) -> str:
    """The JSON schema type of a value decoded from JSON."""
    if isinstance(value, bool):  # before int: True is an int in Python, not in JSON
        return "boolean"
    for python_type, name in _JSON_TYPES:
        if isinstance(value, python_type):
            return name
    return type(value).__name__
