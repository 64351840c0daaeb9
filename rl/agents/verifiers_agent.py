"""verifiers environments (`agent.environment: verifiers:<env id>`), inside the sandbox only.

This module imports the `verifiers` package (an optional extra, `pip install -e
.[verifiers]`) and the environment's own code, so only sandboxed workers import it: the agent
workers (rl.agents.agent_worker, which call `run` once per episode) and the row worker
(`python -m rl.agents.verifiers_agent FD`, driven by rl.agents.ecosystem, which brings the
environment's tasks back as JSON rows). The driver never does.

An episode is the environment's own: verifiers' `Env.run_episode` of the example's task, its
`run()` (the multi-turn protocol: user turns, stops, interceptors), its rubric (the task's
`@vf.reward` functions, weighted), with every model call going from the agent's harness through
verifiers' interception server (on the sandbox's loopback) to the rollout worker's endpoint.
The harness: verifiers' built-in ones (`bash`, `null`, ...) install a program with `uv` from
the network and stream their calls, neither of which a sandbox allows, so an agent seat on a
built-in harness plays `TandemChat` instead: the chat loop of verifiers' `null` harness (the
task's system prompt and prompt, the model's replies, the environment's user turns), in this
process, without streaming and without tools. A harness the environment ships itself is kept.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.utils.loaders import builtin_harness_ids

from rl.agents.ecosystem import VERIFIERS_FIELD, env_id_of

HARNESS_ID = "tandem_chat"  # the module name verifiers imports TandemChat's harness by
# Where the agent's calls go: the endpoint's key is in this variable in an episode's process
# (rl.agents.agent_worker), so no key is written into a config.
API_KEY_VAR = "OPENAI_API_KEY"


class TandemChatConfig(vf.HarnessConfig):
    id: str = HARNESS_ID


class TandemChat(vf.Harness[TandemChatConfig]):
    """verifiers' `null` chat loop, in-process and without streaming: each segment sends the
    conversation so far (system prompt, prompt, earlier replies, the environment's new user
    turns) to the interception endpoint once and takes the reply."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        if mcp_urls:
            raise vf.HarnessError(
                f"the task offers tools ({', '.join(mcp_urls)}), which Tandem's in-sandbox "
                "chat loop does not run: give the environment a harness of its own"
            )
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = []
        if system:
            messages.append({"role": "system", "content": system})
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(message) for message in prompt)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def _register_harness() -> None:
    """Make `TandemChat` importable by its id, as verifiers imports harnesses (a module
    exporting one Harness subclass in `__all__`)."""
    if HARNESS_ID not in sys.modules:
        module = types.ModuleType(HARNESS_ID)
        module.TandemChat, module.TandemChatConfig = TandemChat, TandemChatConfig
        module.__all__ = ["TandemChat"]
        sys.modules[HARNESS_ID] = module


def env_config(env_id: str, config: dict) -> vf.EnvConfig:
    """The environment `env_id`'s config with taskset options `config`, every agent seat on a
    local runtime (this sandbox) and on TandemChat where its harness is a built-in one."""
    _register_harness()
    config_class = vf.env_config_type(env_id)
    builtins = set(builtin_harness_ids())
    default_harness = vf.default_harness_id(env_id)
    seats: dict[str, dict] = {}
    for name, field in config_class.model_fields.items():
        if not isinstance(field.default, vf.AgentConfig):
            continue
        pinned = field.default.harness
        harness = pinned.id if pinned is not None else default_harness
        seats[name] = {"runtime": {"type": "subprocess"}}
        if harness in builtins:
            seats[name]["harness"] = {"id": HARNESS_ID}
    return vf.resolve_env_config({"taskset": {**config, "id": env_id}, **seats})


def rows(env_id: str, config: dict, count: int, seed: int) -> list[dict]:
    """Up to `count` of the environment's tasks as wire data (JSON), shuffled with `seed`
    when the taskset is finite (an infinite one gives its first `count`)."""
    taskset = vf.load_taskset(env_config(env_id, config).taskset)
    if taskset.bounded:
        taskset = taskset.shuffle(seed)
    return [
        task.data.model_dump(mode="json", exclude_defaults=True) for task in taskset.take(count)
    ]


async def _episode(spec: dict, base_url: str, model: str) -> float:
    env = vf.load_environment(env_config(spec["env"], spec.get("config", {})))
    task_class = type(env.taskset).task_type()
    task = task_class(task_class.data_type().model_validate(spec["task"]), env.taskset.config.task)
    client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
    async with env.serving():
        episode = await env.run_episode(task, vf.ModelContext(model=model, client=client))
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors:
        raise RuntimeError(f"the episode failed: {errors[-1].type}: {errors[-1].message}")
    if len(episode.traces) != 1:
        raise ValueError(
            f"verifiers environment {spec['env']!r} ran {len(episode.traces)} agents in an "
            "episode; Tandem trains one sequence per episode, so one agent run"
        )
    return episode.traces[0].reward


def run(example: dict, base_url: str, api_key: str, model: str) -> float:
    """One episode of the example's verifiers task; its reward, the rubric's weighted sum."""
    del api_key  # in API_KEY_VAR, where verifiers' client reads it
    return asyncio.run(_episode(json.loads(example[VERIFIERS_FIELD]), base_url, model))


def prepare(environment: str) -> None:
    """In the agent worker, before any episode forks: import the environment `environment`
    (`verifiers:<env>`) names, its taskset, its Env and their harnesses."""
    env_id = env_id_of(environment)
    _register_harness()
    vf.environment_class(env_id)
    vf.env_config_type(env_id)
    vf.default_agent_harness(env_id)


run.prepare = prepare  # what rl.agents.agent_worker calls, finding it on the function


def main(fd: int) -> None:
    """The row worker: one request {"env", "config", "count", "seed"} on connection `fd`,
    answered with {"rows": [...]} or {"failed": "Type: message"}."""
    from rl.sandbox import connect, describe

    conn = connect(fd)
    request = json.loads(conn.recv_bytes())
    try:
        made = rows(request["env"], request["config"], request["count"], request["seed"])
        reply: dict = {"rows": made}
    except Exception as e:
        reply = {"failed": describe(e)}
    conn.send_bytes(json.dumps(reply).encode())


if __name__ == "__main__":
    main(int(sys.argv[1]))
