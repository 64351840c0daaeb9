"""Generated tasks: each makes prompts with reference answers and scores responses.

A task is a class registered in `TASKS` (rl.data.tasks.task, with the `Task` interface) by its
own module; importing this package imports them all, so `get_task(name)` finds every one and
returns an instance; a family's tasks are named "<family>:<member>" (reasoning_gym:chain_sum,
rl.data.tasks.reasoning_gym). Examples are plain dicts {"prompt": str, "answer": str, ...task
fields} so they round-trip through jsonl.
"""

from __future__ import annotations

# Imported for their registration in TASKS.
from rl.data.tasks import (  # noqa: F401
    addition,
    countdown,
    majority,
    math_answers,
    openenv_env,
    reasoning_gym,
    repeat,
    verifiers_env,
)
from rl.data.tasks.task import TASKS, Task

__all__ = ["TASKS", "Task", "get_task"]


def get_task(name: str) -> Task:
    """The task registered as `name`, or family `f`'s task for "f:member"; ValueError listing
    the valid names otherwise."""
    family, _, member = name.partition(":")
    if family in TASKS and TASKS.traits(family).family:
        return TASKS.get(family)(member)  # which rejects an unknown or missing member
    return TASKS.get(name)()
