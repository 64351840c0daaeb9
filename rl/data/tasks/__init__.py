"""Generated tasks: each makes prompts with reference answers and scores responses.

A task is a class registered in `TASKS` (rl.data.tasks.task, with the `Task` interface) by its
own module; importing this package imports them all, so `get_task(name)` finds every one and
returns an instance. Examples are plain dicts {"prompt": str, "answer": str, ...task fields}
so they round-trip through jsonl.
"""

from __future__ import annotations

# Imported for their registration in TASKS.
from rl.data.tasks import addition, countdown, math_answers, repeat  # noqa: F401
from rl.data.tasks.task import TASKS, Task

__all__ = ["TASKS", "Task", "get_task"]


def get_task(name: str) -> Task:
    """The task registered as `name`; ValueError listing the valid names otherwise."""
    return TASKS.get(name)()
