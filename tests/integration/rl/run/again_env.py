"""A user's environment for test_rollout_fault.py: asks for the answer again after each of
the first two turns, so that every episode has three turns whatever the model writes."""

from __future__ import annotations

from rl.agents.environment import Environment, EnvStep


class Again(Environment):
    def reset(self, example: dict) -> list[dict]:
        self.turns = 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, turn: str, tool_messages: list[dict]) -> EnvStep:
        self.turns += 1
        if self.turns == 3:
            return EnvStep(done=True)
        return EnvStep([{"role": "user", "content": "again"}])

    def demonstration(self, example: dict) -> list[dict]:
        answer = {"role": "assistant", "content": example["answer"]}
        again = {"role": "user", "content": "again"}
        return [*self.reset(example), answer, again, answer, again, answer]
