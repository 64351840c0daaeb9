"""A verifiers environment's tasks as the run's data: `data.task: verifiers:<env>`, with
`agent.environment: verifiers:<env>` running its episodes (rl.agents.ecosystem, docs/agents.md
"Environments from the ecosystem").

The examples are the environment's own tasks, made by its taskset in a sandboxed worker (its
code never runs here) with `data.task_config` as the taskset's options, shuffled with a seed
drawn from the split's rng; `data.num_test + data.num_train` of them in all, the test split
first. Each example carries its task's wire data (the `verifiers` field) for the agent
function, the prompt's text and the task's `answer` field where it has one.

The reward is the environment's rubric, which scores an episode's whole trace: the agent
function returns it, and held-out evaluation reads it (`scores_episodes`). A response alone
cannot be scored, so `score` gives 0.0 (the term `task` adds nothing; a base's held-out
accuracy, measured on base.environment's episodes, reads 0).
"""

from __future__ import annotations

import random

from rl.agents.ecosystem import VERIFIERS_PREFIX, EcosystemEnv, ecosystem_env, load_rows
from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

PREFIX = VERIFIERS_PREFIX.rstrip(":")


class VerifiersTasks(Task):
    """The tasks of one verifiers environment, named by `get_task("verifiers:<env>")`."""

    param_fields = ("task_config",)
    scores_episodes = True

    def __init__(self, member: str) -> None:
        self.name = f"{PREFIX}:{member}"
        # The environment's examples, made once per (config, seed, count) and handed out in
        # order across `generate` calls, so the test split's never come back for train.
        self._made: tuple[str, list[dict]] | None = None
        self._next = 0

    def env(self) -> EcosystemEnv:
        """The environment; ValueError naming data.task when it cannot be one. (Not resolved
        at construction: a reward worker builds the task to score with, from another working
        directory, where a local environment's relative path leads nowhere.)"""
        env = ecosystem_env(self.name, "data.task")
        assert env is not None
        return env

    def check(self, cfg: DataConfig) -> None:
        super().check(cfg)
        self.env()

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        count = cfg.num_train + cfg.num_test
        key = repr((sorted(cfg.task_config.items()), cfg.seed, count))
        if self._made is None or self._made[0] != key:
            made = load_rows(self.env(), dict(cfg.task_config), count, rng.randrange(2**31))
            self._made, self._next = (key, made), 0
        examples = self._made[1][self._next : self._next + num]
        self._next += len(examples)
        return examples

    def score(self, response: str, example: dict) -> float:
        return 0.0


TASKS.register(PREFIX, family=True)(VerifiersTasks)
