"""The task interface and the registry of tasks by name, which each task's module fills as it
is imported (rl.data.tasks imports them all)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from rl.config import DataConfig
from rl.config.registry import Registry


@dataclass(frozen=True)
class TaskTraits:
    # The registered name is a family's prefix: its tasks are named "<prefix>:<member>"
    # (reasoning_gym:chain_sum) and its class is built with the member.
    family: bool = False


TASKS: Registry = Registry("task", TaskTraits)


class Task:
    """Interface of a task. Subclasses set `name` and `param_fields` and register themselves."""

    name: ClassVar[str]
    # DataConfig fields that change what `generate` produces (they key the cached splits).
    param_fields: ClassVar[tuple[str, ...]] = ()
    # True when examples come only from data.train_files/test_files (nothing to generate).
    needs_files: ClassVar[bool] = False
    # True when only a whole episode can be scored (an ecosystem environment's rubric, which
    # its agent function returns as the episode's reward): evaluation reads that reward.
    scores_episodes: ClassVar[bool] = False

    def check(self, cfg: DataConfig) -> None:
        """Before any work: ValueError naming the data.* key that this task cannot use."""
        if cfg.task_config and "task_config" not in self.param_fields:
            raise ValueError(
                f"data.task_config is set but data.task={self.name} takes none (it configures "
                "reasoning_gym:<dataset>, verifiers:<env> and openenv:<env> tasks)"
            )

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        """`num` examples drawn with `rng` (duplicates possible; splits dedupe by prompt)."""
        raise NotImplementedError

    def score(self, response: str, example: dict) -> float:
        """1.0 when `response` answers `example` correctly, else 0.0; never raises on junk."""
        raise NotImplementedError
