"""A calculator agent written against the plain `openai` SDK, as agents are written for any
OpenAI-compatible server: recipes/agent_openai_cpu.yaml trains the policy behind it.

Tandem runs `run(example, base_url=..., api_key=..., model=...)` once per episode, in a
sandbox whose only network is the rollout worker's endpoint at `base_url` (docs/agents.md).
The agent offers the model a `python` tool, runs the code the model writes in its own process
(an episode's process, in its sandbox, ended with the episode), shows the output back, and
returns the model's first answer without a call.
"""

import contextlib
import io
import json

import openai

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code; returns what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source code."}},
            "required": ["code"],
        },
    },
}
MAX_CALLS = 4
MAX_OUTPUT_CHARS = 200


def python(code: str) -> str:
    """What `code` prints (or the error it raises), cut to MAX_OUTPUT_CHARS."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__main__"})
    except Exception as e:
        out.write(f"{type(e).__name__}: {e}")
    return out.getvalue()[:MAX_OUTPUT_CHARS]


def run(example: dict, base_url: str, api_key: str, model: str) -> str | None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": example["prompt"]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[PYTHON])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            code = json.loads(call.function.arguments).get("code", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": python(str(code))})
    return None
