"""OpenEnv environments (`agent.environment: openenv:<env>`), inside the sandbox only.

This module imports the `openenv` package (`openenv-core`, an optional extra: `pip install -e
.[openenv]`) and the environment's server code, so only the sandboxed agent workers
(rl.agents.agent_worker) import it; the driver never does.

An OpenEnv environment is a package laid out as `openenv init` makes it: `<env>/server/app.py`
defines `app`, the FastAPI application `openenv.core.env_server.create_app` builds around the
environment's class. `prepare` imports it once in the agent worker. Each episode then starts
its own server: a fork of the episode's process serving `app` with uvicorn on the sandbox's
loopback (the environment's `max_concurrent_envs`, often 1, is then never a limit), ended with
the episode's process group. The episode reaches it through OpenEnv's own client
(`GenericEnvClient`, the WebSocket session) and plays the environment with the policy behind
the rollout worker's endpoint, as verifiers' OpenEnv taskset does:

- the first user message is `{"observation": ..., "action_schema": ...}` as JSON (the reset's
  observation, and the fields an action takes); each later one `{"observation": ...}`;
- the model's reply is the action: a JSON object (fenced or not), or, for an action with one
  required field, the reply's text as that field;
- the episode ends when the environment says `done`, when the endpoint ends it (finish reason
  "length": the turn limit or the token budget), or at the first reply that is not a valid
  action (a policy's mistake, not an error: it keeps the rewards so far);
- the reward is the sum of the steps' rewards.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
from typing import Any

import httpx
import uvicorn
from openai import AsyncOpenAI
from openenv.core import GenericEnvClient

from rl.agents.ecosystem import OPENENV, env_id_of

APP = "server.app"  # the module, in the environment's package, that defines `app`
VALIDATION_ERROR = "VALIDATION_ERROR"  # OpenEnv's error code for an action its model rejects
SCHEMA_TIMEOUT_S = 30.0

_app: Any = None  # the environment's ASGI application, imported by `prepare`


class InvalidAction(ValueError):
    """The model's reply is not an action of the environment."""


def action_fields(schema: dict) -> dict:
    """What an action takes, from its JSON schema: its fields' types and descriptions, and
    which are required. OpenEnv's `metadata`, on every action, is the client's, not the
    model's."""
    fields = {
        name: {k: v for k, v in spec.items() if k in ("type", "description", "enum")}
        for name, spec in schema.get("properties", {}).items()
        if name != "metadata"
    }
    return {"fields": fields, "required": list(schema.get("required", []))}


def parse_action(reply: str, fields: dict) -> dict:
    """The model's reply as an action: a JSON object, fenced or not, or, for an action with
    one required field, the reply's text as that field (the environment's model converts it,
    "7" into an int field). InvalidAction when it is neither."""
    text = reply.strip()
    if text.startswith("```") and text.endswith("```"):
        text = "\n".join(text.splitlines()[1:-1]).strip()
    try:
        action = json.loads(text)
    except ValueError:
        action = None
    if isinstance(action, dict):
        return action
    required = fields["required"]
    if len(required) != 1:
        raise InvalidAction(f"not a JSON object of {sorted(fields['fields'])}: {reply[:80]!r}")
    if not text:
        raise InvalidAction("an empty reply")
    return {required[0]: text}


def observation_message(observation: dict, fields: dict | None) -> dict:
    """The user turn that shows the model `observation` (with the action's fields, first)."""
    content = {"observation": observation}
    if fields is not None:
        content["action_schema"] = fields
    return {"role": "user", "content": json.dumps(content, ensure_ascii=False, sort_keys=True)}


def serve_episode_env() -> str:
    """Fork a server of the environment's app on a free loopback port; its base URL. The
    socket listens before the fork, so the client's first connection waits in its backlog
    rather than racing the server's start. The server stays in the episode's process group,
    which the agent worker kills when the episode ends."""
    assert _app is not None, "prepare() imports the environment's app first"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    if os.fork() == 0:
        # The episode's descriptors stay with the episode: its result pipe, held open here,
        # would keep the agent worker from ever reading the episode's end.
        keep = sock.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            # Quiet: what goes wrong in the environment reaches the episode as the server's
            # error reply; OpenEnv's server also logs a client's normal goodbye as an error.
            config = uvicorn.Config(_app, log_level="critical")
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            os._exit(0)
    sock.close()
    return f"http://127.0.0.1:{port}"


async def play(spec: dict, env_url: str, base_url: str, model: str) -> float:
    """One episode of the environment at `env_url`, reset with `spec["reset"]`, played by the
    model behind `base_url`; the sum of its steps' rewards."""
    async with httpx.AsyncClient(timeout=SCHEMA_TIMEOUT_S) as http:
        response = await http.get(f"{env_url}/schema")
        response.raise_for_status()
    fields = action_fields(response.json()["action"])
    policy = AsyncOpenAI(base_url=base_url, max_retries=0)  # the key: OPENAI_API_KEY
    total = 0.0
    async with GenericEnvClient(base_url=env_url) as env:
        result = await env.reset(**spec.get("reset", {}))
        messages = [observation_message(result.observation, fields)]
        while not result.done:
            reply = await policy.chat.completions.create(model=model, messages=messages)
            choice = reply.choices[0]
            text = choice.message.content or ""
            messages.append({"role": "assistant", "content": text})
            if choice.finish_reason == "length":
                break  # the turn limit or the token budget: the endpoint ends the episode
            try:
                result = await env.step(parse_action(text, fields))
            except InvalidAction:
                break
            except RuntimeError as e:  # the client's form of the server's error messages
                if f"(code: {VALIDATION_ERROR})" in str(e):
                    break  # fields the action's model rejects: the policy's mistake
                raise
            total += float(result.reward or 0.0)
            messages.append(observation_message(result.observation, None))
    await policy.close()
    return total


def run(example: dict, base_url: str, api_key: str, model: str) -> float:
    """One episode of the example's OpenEnv environment (its `openenv` field: the reset's
    arguments), on a server of its own; its reward."""
    del api_key  # in OPENAI_API_KEY, where the openai client reads it
    spec = json.loads(example[OPENENV.field])
    return asyncio.run(play(spec, serve_episode_env(), base_url, model))


def prepare(environment: str) -> None:
    """In the agent worker, before any episode forks: import the app of the environment
    `environment` (`openenv:<env>`) names, with OpenEnv's server and the environment's code."""
    global _app
    module = importlib.import_module(f"{env_id_of(environment)}.{APP}")
    _app = getattr(module, "app", None)
    if not callable(_app):
        raise ValueError(
            f"{environment}: {module.__name__} defines no `app` (the environment's FastAPI "
            "application, openenv.core.env_server.create_app(...))"
        )


run.prepare = prepare  # what rl.agents.agent_worker calls, finding it on the function
