"""Users' environments for tests/unit/rl/agents/test_env_pool.py, named by path as a user
names theirs (`tests/unit/rl/agents/sample_envs.py:Countdown`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rl.agents.environment import Environment, EnvStep


class Countdown(Environment):
    """Counts the turns in its own state; ends after `example["turns"]` of them, rewarding
    each turn with its number. A turn says what to do: "raise", "hang", "die", "junk" or
    "wrong messages" fail the step in that way."""

    tools = ("python",)

    def reset(self, example: dict) -> list[dict]:
        self.turns, self.left = 0, example["turns"]
        # What a tool or environment must never see: the driver's credentials.
        secret = os.environ.get("TANDEM_TEST_TOKEN", "none")
        return [{"role": "user", "content": f"count to {self.left} (secret: {secret})"}]

    def step(self, turn: str, tool_messages: list[dict]) -> EnvStep:
        if turn == "raise":
            raise KeyError("no such key")
        if turn == "hang":
            time.sleep(3600)
        if turn.startswith("fork and hang "):  # the rest: a marker the test finds it by
            code = f"import time; time.sleep(3600)  # {turn.rpartition(' ')[2]}"
            subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            time.sleep(3600)
        if turn == "die":
            os._exit(3)
        if turn == "junk":
            return EnvStep(reward=float("nan"))
        if turn == "wrong messages":
            return EnvStep(messages=[{"role": "user", "content": 7}])
        self.turns += 1
        self.left -= 1
        observation = [{"role": "user", "content": f"turn {self.turns} done"}]
        return EnvStep(observation, reward=float(self.turns), done=self.left == 0)

    def demonstration(self, example: dict) -> list[dict]:
        return [*self.reset(example), {"role": "assistant", "content": "1 2 3"}]


class SlowReset(Countdown):
    """A Countdown whose reset takes `example["reset_s"]` seconds."""

    def reset(self, example: dict) -> list[dict]:
        time.sleep(example["reset_s"])
        return super().reset(example)


class NotAnEnvironment:
    tools = ()
