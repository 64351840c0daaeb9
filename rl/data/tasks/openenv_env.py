"""An OpenEnv environment's episodes as the run's data: `data.task: openenv:<env>`, with
`agent.environment: openenv:<env>` running them (rl.agents.openenv_agent, docs/agents.md
"Environments from the ecosystem").

An OpenEnv environment makes its own tasks when it resets, so an example is the reset's
arguments: a seed drawn from the split's rng, plus `data.task_config` (the environment's own
reset options, passed to every reset) in the `openenv` field, as JSON. Nothing of the
environment runs to make them. The prompt only names the episode (the data pipeline keys
examples by prompt); the model sees the environment's observations.

The reward is the sum of the environment's step rewards, which the agent function returns and
held-out evaluation reads (`scores_episodes`); a response alone cannot be scored, so `score`
gives 0.0.
"""

from __future__ import annotations

import json
import random

from rl.agents.ecosystem import OPENENV, EcosystemEnv, ecosystem_env
from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

PREFIX = OPENENV.prefix.rstrip(":")


class OpenEnvTasks(Task):
    """The episodes of one OpenEnv environment, named by `get_task("openenv:<env>")`."""

    param_fields = ("task_config",)
    scores_episodes = True

    def __init__(self, member: str) -> None:
        self.name = f"{PREFIX}:{member}"

    def env(self) -> EcosystemEnv:
        """The environment; ValueError naming data.task when it cannot be one (resolved when
        asked: a reward worker builds the task from another working directory)."""
        env = ecosystem_env(self.name, "data.task")
        assert env is not None
        return env

    def check(self, cfg: DataConfig) -> None:
        super().check(cfg)
        if "seed" in cfg.task_config:
            raise ValueError(
                f"data.task_config.seed: each episode's reset seed is drawn from data.seed for "
                f"data.task={self.name}; data.task_config holds the reset's other arguments"
            )
        self.env()

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        env_id = self.env().env_id
        examples = []
        for _ in range(num):
            seed = rng.randrange(2**31)
            spec = {"env": env_id, "reset": {**cfg.task_config, "seed": seed}}
            examples.append(
                {
                    "prompt": f"[{env_id} episode {seed}]",
                    "answer": "",
                    OPENENV.field: json.dumps(spec, sort_keys=True),
                }
            )
        return examples

    def score(self, response: str, example: dict) -> float:
        return 0.0


TASKS.register(PREFIX, family=True)(OpenEnvTasks)
