"""Agent functions for tests/integration/rollout/test_api_agent_loop.py, written as users write
them: the plain `openai` SDK against the `base_url` they are given. Run only in their
sandboxes (rl.agents.agent_worker)."""

import socket
import time

import openai

from tests.helpers.chat_templates import WEATHER_TOOL as WEATHER

TURNS = 3


def _client(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def _ask(client: openai.OpenAI, model: str, messages: list) -> object:
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0.0
    )
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    return reply


def conversation(example: dict, base_url: str, api_key: str, model: str) -> str | None:
    """TURNS calls, each after a user's message: the history the SDK hands back grows by
    appending, so the episode is one sequence."""
    client = _client(base_url, api_key)
    messages = [{"role": "user", "content": example["prompt"]}]
    for turn in range(TURNS):
        _ask(client, model, messages)
        messages.append({"role": "user", "content": f"Go on ({turn})."})
    return None


def rewarded(example: dict, base_url: str, api_key: str, model: str) -> float:
    conversation(example, base_url, api_key, model)
    return 0.25


def raises(example: dict, base_url: str, api_key: str, model: str) -> str:
    _ask(_client(base_url, api_key), model, [{"role": "user", "content": example["prompt"]}])
    raise RuntimeError("the agent's own bug")


def hangs(example: dict, base_url: str, api_key: str, model: str) -> str:
    _ask(_client(base_url, api_key), model, [{"role": "user", "content": example["prompt"]}])
    time.sleep(3600)
    return "never"


def floods(example: dict, base_url: str, api_key: str, model: str) -> str:
    """Calls without end: past agent.max_turns each call is refused (finish_reason length)."""
    client = _client(base_url, api_key)
    messages = [{"role": "user", "content": example["prompt"]}]
    while True:
        reply = _ask(client, model, messages)
        messages.append({"role": "user", "content": reply.choices[0].finish_reason})


def without_calls(example: dict, base_url: str, api_key: str, model: str) -> str:
    return "an answer the policy never wrote"


def reaches_out(example: dict, base_url: str, api_key: str, model: str) -> str:
    """What the sandbox lets it reach: the host's TCP port the test listens on, and the
    endpoint with another key than its own."""
    client = _client(base_url, api_key)
    _ask(client, model, [{"role": "user", "content": example["prompt"]}])
    found = []
    try:
        socket.create_connection(("127.0.0.1", example["port"]), timeout=2).close()
        found.append("host port: reached")
    except OSError as e:
        found.append(f"host port: {type(e).__name__}")
    try:
        _ask(_client(base_url, "not-my-key"), model, [{"role": "user", "content": "hi"}])
        found.append("other key: served")
    except openai.AuthenticationError:
        found.append("other key: refused")
    return "; ".join(found)


def completions(example: dict, base_url: str, api_key: str, model: str) -> str:
    """Raw completions: the agent writes the template itself and appends each reply."""
    client = _client(base_url, api_key)
    prompt = f"<|im_start|>user\n{example['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    for _ in range(2):
        text = client.completions.create(model=model, prompt=prompt, max_tokens=8).choices[0].text
        prompt += text + "\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"
    return text


def trims(example: dict, base_url: str, api_key: str, model: str) -> None:
    """A framework that keeps only the last exchange: every call after the first drops the
    history before it, so each starts a segment of its own."""
    client = _client(base_url, api_key)
    messages = [{"role": "user", "content": example["prompt"]}]
    for turn in range(TURNS):
        _ask(client, model, messages)
        messages = messages[-1:] + [{"role": "user", "content": f"Go on ({turn})."}]
