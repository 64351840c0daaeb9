"""What a multi-turn agent interacts with: an environment class, and the built-in ones by name.

An environment is a plain Python class (docs/agents.md has a complete example):

- `tools`: the tools the policy may call, as `rl.agents.tool_pool.ToolPool` takes them
  (built-in names such as "python", or "path/to/file.py:function"). Their JSON schemas go
  into the chat template's `tools`; calls run only in the pool's sandboxed worker processes.
- `reset(example)`: the episode's first messages, from a data example. Every sample of a
  group starts from the same example and must get the same messages (GRPO compares answers
  to one prompt).
- `step(turn, tool_messages)`: after each assistant turn, given its text and the results of
  the tool calls it made (one "tool" message each, errors included), the observation to
  append, a reward, and whether the episode is over. The default ends the episode at the
  first turn without a tool call and shows the tool results otherwise.
- `demonstration(example)`: optionally, the whole conversation of a correct episode, which
  `rl build-base` fine-tunes a base model on.

Built-in environments are registered in `ENVIRONMENTS`; a user's is named
`path/to/file.py:ClassName` and runs only in sandboxed workers (rl.agents.env_pool), so it must
be picklable: its state travels, pickled, with the episode. rl.agents.resolve finds the class
an agent set-up names, either kind.

An episode's reward is the task's reward of its last assistant message (the answer, scored by
`reward.terms` like a single-turn response) plus the sum of `step`'s rewards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rl.agents.agent_pool import agent_function
from rl.config.registry import NoTraits, Registry
from rl.user_code import check_file_object, parse_file_ref

Message = dict[str, Any]


@dataclass
class EnvStep:
    messages: list[Message] = field(default_factory=list)  # the observation; empty when done
    reward: float = 0.0
    done: bool = False


class Environment:
    """The interface, with the default `step`; subclasses set `tools` and `reset`."""

    tools: ClassVar[tuple[str, ...]] = ()

    def reset(self, example: dict) -> list[Message]:
        raise NotImplementedError

    def step(self, turn: str, tool_messages: list[Message]) -> EnvStep:
        """Show the tool results; the first turn that calls no tool is the answer."""
        return EnvStep(messages=tool_messages, done=not tool_messages)

    def demonstration(self, example: dict) -> list[Message] | None:
        return None


ENVIRONMENTS: Registry[type[Environment], NoTraits] = Registry("agent environment")


@ENVIRONMENTS.register("tool_use")
class ToolUse(Environment):
    """The example's prompt as the user's message, and whatever tools `agent.tools` lists."""

    def reset(self, example: dict) -> list[Message]:
        return [{"role": "user", "content": example["prompt"]}]


@ENVIRONMENTS.register("calculator")
class Calculator(ToolUse):
    """Arithmetic with the built-in `python` tool: the model should hand the expression to
    the tool and answer with its result. With numbers too long for a small model to add
    reliably (the `addition` task with many digits), the tool is what makes it right.

    The demonstration has Python print the result in the answer's own width (zero-padded
    when the task pads answers), so the model only copies it: a small model that must copy
    results of two lengths learns them as two skills, as it learns two sum layouts
    (rl.data.tasks.addition)."""

    tools = ("python",)

    def demonstration(self, example: dict) -> list[Message]:
        width = len(example["answer"])
        code = f"print(f'{{{example['prompt']}:0{width}d}}')"
        call = json.dumps({"name": "python", "arguments": {"code": code}})
        return [
            *self.reset(example),
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "name": "python", "content": example["answer"] + "\n"},
            {"role": "assistant", "content": example["answer"]},
        ]


def check_environment(name: str) -> None:
    """Without running a user's code: `name` is a registered environment, a
    `path/to/file.py:ClassName` or an agent function's `openai:path/to/file.py:function` whose
    file parses and defines it, or an ecosystem's `verifiers:<env>` / `openenv:<env>`
    (rl.agents.ecosystem) whose package is installed. ValueError naming it."""
    what = f"agent.environment {name!r}"
    function = agent_function(name)
    if function is not None:
        check_file_object(what, *function)
        return
    user = parse_file_ref(name, what)
    if user is not None:
        check_file_object(what, *user)
    elif name not in ENVIRONMENTS:
        raise ValueError(
            f"{what} is neither a built-in environment ({', '.join(ENVIRONMENTS.names())}), "
            "'path/to/file.py:ClassName', 'openai:path/to/file.py:function', "
            "'verifiers:<env>' nor 'openenv:<env>'"
        )
