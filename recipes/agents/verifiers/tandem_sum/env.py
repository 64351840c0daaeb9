"""The tandem_sum environment (see the package docstring)."""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

RETRY = "Not quite. What is {question}?"


class SumConfig(vf.TasksetConfig):
    num_tasks: int = Field(400, ge=1)
    """How many distinct sums the taskset holds."""
    digits: int = Field(2, ge=1)
    """Digits of each number."""


class SumData(vf.TaskData):
    question: str
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def first_try(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return float(bool(replies) and (replies[0].content or "").strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        rng = random.Random(0)
        low, high = 10 ** (self.config.digits - 1), 10**self.config.digits - 1
        pairs: dict[tuple[int, int], None] = {}
        while len(pairs) < self.config.num_tasks:
            pairs[rng.randint(low, high), rng.randint(low, high)] = None
        return [
            SumTask(
                SumData(prompt=f"What is {a}+{b}?", question=f"{a}+{b}", answer=str(a + b)),
                self.config.task,
            )
            for a, b in pairs
        ]


class SumEnv(vf.SingleAgentEnv):
    """A wrong first answer is told so, as a user turn, and gets one more try."""

    async def run(self, task: SumTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated and segment.last_reply != task.data.answer:
                retry = RETRY.format(question=task.data.question)
                await interaction.turn([vf.UserMessage(content=retry)])
