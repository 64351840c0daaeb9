"""The tandem_echo environment (see the package docstring)."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone", "cloud", "ember", "maple")
AGAIN = "Say it once more: {word}"
LETTER_WEIGHT = 0.5


def letters(reply: str, word: str) -> float:
    """The share of the word's distinct letters that the reply holds."""
    wanted = set(word)
    return len(wanted & set(reply.lower())) / len(wanted)


def reward_of(replies: list[str], word: str) -> float:
    """What the rubric gives an episode whose assistant replies were `replies`: the first
    reply's letters (weight LETTER_WEIGHT) plus whether the word is in the last reply."""
    return LETTER_WEIGHT * letters(replies[0], word) + float(word in replies[-1].lower())


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=LETTER_WEIGHT)
    async def first_letters(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return letters(replies[0].content or "", self.data.word) if replies else 0.0

    @vf.reward(weight=1.0)
    async def said_it(self, trace: vf.Trace) -> float:
        return float(self.data.word in trace.last_reply.lower())

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self) -> list[EchoTask]:
        return [
            EchoTask(EchoData(prompt=f"Say the word {word}.", word=word), self.config.task)
            for word in WORDS
        ]


class EchoEnv(vf.SingleAgentEnv):
    """The model answers the prompt; the environment then asks once more, as a user turn."""

    async def run(self, task: EchoTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn([vf.UserMessage(content=AGAIN.format(word=task.data.word))])
