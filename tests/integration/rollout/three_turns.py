"""The scripted environment of test_agent_loop.py, a user's file: it runs in sandboxed
environment workers as users' environments do (rl.agents.env_pool)."""

from __future__ import annotations

from rl.agents.environment import Environment, EnvStep

NUM_TURNS = 3


class ThreeTurns(Environment):
    """Answers each assistant turn until the third: with the results of its tool calls when
    it made any, else with a scripted tool result (after the first turn) or a user's reply
    (after the second). Its state travels with the sample, like every environment's."""

    tools = ("python",)

    def reset(self, example: dict) -> list[dict]:
        self.turns = 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, turn: str, tool_messages: list[dict]) -> EnvStep:
        self.turns += 1
        if self.turns == NUM_TURNS:
            return EnvStep(reward=1.0, done=True)
        if tool_messages:
            return EnvStep(tool_messages, reward=0.5)
        if self.turns == 1:
            return EnvStep([{"role": "tool", "name": "python", "content": "4"}], reward=0.5)
        return EnvStep([{"role": "user", "content": "Check it with python, please."}])
