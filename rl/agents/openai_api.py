"""The OpenAI chat-completions wire format as the rollout workers' endpoint speaks it
(rollout.endpoint): requests read and checked, messages normalised so that the history an
agent sends back can be compared with what it was served, and replies built from the text the
policy sampled.

What a request may ask: `messages` (text content, or a list of text parts), `tools` (function
schemas), `tool_choice` "auto" or "none", `n` 1, `stream` off, `max_tokens` /
`max_completion_tokens` (a cap on the turn). What it may not change: the sampling itself.
`temperature`, `top_p`, `seed` and the like are the recipe's, whatever the request says,
since the trainer scores every sampled token under the recipe's sampling (a request's
temperature 0 would make the behaviour log-probs of another policy). Anything else an SDK
sends (`model`, `user`, `metadata`, ...) is ignored.

Normalised messages keep what the chat template renders and nothing an SDK adds on the way
back (`refusal: null`, `annotations`, `audio`): role, content (text), an assistant's tool
calls (id, name, arguments parsed from their JSON), a tool message's `tool_call_id` and name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl.agents.tool_calls import TOOL_CALL_FORMATS, ToolCall, ToolCallError

ROLES = ("system", "developer", "user", "assistant", "tool")
# What a chat template knows a "developer" message as (OpenAI's newer name for system).
_TEMPLATE_ROLE = {"developer": "system"}


class BadRequest(ValueError):
    """A request the endpoint refuses (HTTP 400), the reason in words the agent's author can
    act on."""


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalised
    tools: list[dict[str, Any]] | None  # function schemas, as sent
    max_tokens: int | None  # the turn's cap, if the request sets one

    def record(self) -> dict[str, Any]:
        """As an episode records it (JSON): what a re-run agent's call must equal."""
        return {"messages": self.messages, "tools": self.tools, "max_tokens": self.max_tokens}


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int | None

    def record(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens}


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body is a JSON {type(body).__name__}, not an object")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body['n']!r}: an episode is one sequence, so one choice (n=1)")
    if body.get("stream"):
        raise BadRequest("stream=true is not served: ask with stream off")
    return body


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"max_tokens={value!r} is not a positive integer")
    return value


def _text(content: object, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or null (empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: content part of type {kind!r}; only text is served")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: a text part without a string 'text'")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content is a {type(content).__name__}, not text")


def _arguments(arguments: object, where: str) -> Any:
    """A tool call's arguments: the JSON object its string holds (kept as the string if it is
    not JSON, as a model may write)."""
    if not isinstance(arguments, str):
        raise BadRequest(f"{where}: function.arguments is not a string")
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def normalize_message(message: object, where: str) -> dict[str, Any]:
    """`message` as compared and recorded (the module's docstring); BadRequest naming `where`
    when it is not a chat message."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} is not an object")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "assistant" and message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise BadRequest(f"{where}: tool_calls is not a list")
        out["tool_calls"] = []
        for k, call in enumerate(calls):
            at = f"{where}.tool_calls[{k}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                raise BadRequest(f"{at}: no function name")
            out["tool_calls"].append(
                {
                    "id": str(call.get("id", "")),
                    "name": function["name"],
                    "arguments": _arguments(function.get("arguments", "{}"), at),
                }
            )
    if role == "tool":
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(
            f"tool_choice={choice!r}: the policy decides whether to call a tool (what RL "
            "trains), so only 'auto' and 'none' are served"
        )
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools is not a list")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            raise BadRequest(
                f"tools[{k}] is not {{'type': 'function', 'function': {{'name': ...}}}}"
            )
    return tools


def parse_chat_request(body: object) -> ChatRequest:
    """A /v1/chat/completions request; BadRequest saying what it asks that is not served."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    normalised = [normalize_message(m, f"messages[{k}]") for k, m in enumerate(messages)]
    return ChatRequest(normalised, _tools(body), _max_tokens(body))


def parse_completion_request(body: object) -> CompletionRequest:
    """A /v1/completions request (one prompt string)."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be one non-empty string")
    return CompletionRequest(prompt, _max_tokens(body))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised messages as HF chat templates take them: tool calls as
    {"type": "function", "function": {"name", "arguments": object}}."""
    out = []
    for m in messages:
        t: dict[str, Any] = {
            "role": _TEMPLATE_ROLE.get(m["role"], m["role"]),
            "content": m["content"],
        }
        if "name" in m:
            t["name"] = m["name"]
        if "tool_calls" in m:
            t["tool_calls"] = [
                {
                    "type": "function",
                    "id": c["id"],
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in m["tool_calls"]
            ]
        if "tool_call_id" in m:
            t["tool_call_id"] = m["tool_call_id"]
        out.append(t)
    return out


def reply_message(
    text: str, calls: list[ToolCall | ToolCallError], call_format: str, call_id: str
) -> dict[str, Any]:
    """The assistant message (OpenAI form) for `text`, the sampled turn, whose calls
    (rl.agents.tool_calls.parse_tool_calls) are `calls`: when they are all well-formed calls
    of known tools with valid arguments, as `tool_calls` (ids `{call_id}_{k}`), their syntax
    removed from the content; otherwise the text as written, for the agent to show back or
    not."""
    if not calls or not all(isinstance(c, ToolCall) for c in calls):
        return {"role": "assistant", "content": text}
    # The calls' syntax leaves the content, as vLLM's and the SDKs' tool parsers do.
    content = TOOL_CALL_FORMATS.traits(call_format).block.sub("", text).strip() or None
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": f"{call_id}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(calls)
        ],
    }
