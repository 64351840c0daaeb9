"""The task interface and the registry of tasks by name, which each task's module fills as it
is imported (rl.data.tasks imports them all)."""

from __future__ import annotations

import random
from typing import ClassVar

from rl.config import DataConfig
from rl.config.registry import Registry

TASKS: Registry = Registry("task")


class Task:
    """Interface of a task. Subclasses set `name` and `param_fields` and register themselves."""

    name: ClassVar[str]
    # DataConfig fields that change what `generate` produces (they key the cached splits).
    param_fields: ClassVar[tuple[str, ...]] = ()
    # True when examples come only from data.train_files/test_files (nothing to generate).
    needs_files: ClassVar[bool] = False

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        """`num` examples drawn with `rng` (duplicates possible; splits dedupe by prompt)."""
        raise NotImplementedError

    def score(self, response: str, example: dict) -> float:
        """1.0 when `response` answers `example` correctly, else 0.0; never raises on junk."""
        raise NotImplementedError
