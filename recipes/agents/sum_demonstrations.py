"""Demonstrations of the tandem_sum verifiers environment's protocol, which
recipes/verifiers_sum_cpu.yaml builds its base from (`base.environment`): the prompt as the
user's message, the sum as the answer. A verifiers environment has no demonstrations of its
own, as an agent function has none."""

from rl.agents.environment import Environment, EnvStep


class SumDemonstrations(Environment):
    def reset(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, turn: str, tool_messages: list[dict]) -> EnvStep:
        return EnvStep(done=True)

    def demonstration(self, example: dict) -> list[dict]:
        return [*self.reset(example), {"role": "assistant", "content": example["answer"]}]
