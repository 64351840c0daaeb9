"""The agent function of bench/agents.py's endpoint side: the scripted workload's episode,
written against the plain `openai` SDK. Each turn, the model's `python` call runs here (in the
agent's own sandboxed process) and its output is shown back, as the native side's scripted
environment shows the tool pool's; after `example["turns"]` turns it returns the seconds each
call took as seen from here, as JSON (the bench's measure of the HTTP and SDK overhead)."""

import contextlib
import io
import json
import os
import time

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


def run(example: dict, base_url: str, api_key: str, model: str) -> str:
    os.environ[example["sleep_var"]] = str(example["sleep_s"])  # what the call's code reads
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": example["prompt"]}]
    seconds = []
    for turn in range(example["turns"]):
        start = time.perf_counter()
        reply = client.chat.completions.create(model=model, messages=messages, tools=[PYTHON])
        seconds.append(time.perf_counter() - start)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if turn + 1 == example["turns"] or not message.tool_calls:
            break
        for call in message.tool_calls:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(json.loads(call.function.arguments)["code"], {"__name__": "__main__"})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out.getvalue()})
    return json.dumps(seconds)
