"""The example environment of docs/agents.md ("Writing an environment"), run as printed: no
way of being cut short (rambling into rollout.max_new_tokens, or stopped by agent.max_turns)
pays better than answering wrong."""

from __future__ import annotations

import itertools
import re

from tests.helpers.repo import REPO

ANSWER, WRONG = "cat", "cow"


def _example_class() -> type:
    doc = (REPO / "docs" / "agents.md").read_text()
    section = doc.split("## Writing an environment", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/agents.md: no Python block under 'Writing an environment'"
    namespace: dict = {}
    exec(code.group(1), namespace)  # the docs' own code, as a user would copy it
    return namespace["GuessTheWord"]


def _task_reward(answer: str) -> float:
    """The task's reward of an episode's last assistant message: exact match."""
    return float(answer.strip() == ANSWER)


def test_being_cut_short_pays_no_more_than_a_wrong_answer() -> None:
    env_class = _example_class()
    finished = []
    cut_short = [_task_reward("The word could be one of")]  # the first turn rambled into the limit
    # Every sequence of answers the policy could give (tool calls change no reward).
    for length in range(1, 4):
        for answers in itertools.product([ANSWER, WRONG], repeat=length):
            env = env_class()
            env.reset({"prompt": "Guess the word.", "answer": ANSWER})
            env_reward = 0.0
            for k, answer in enumerate(answers):
                step = env.step(answer, [])
                env_reward += step.reward
                if step.done:
                    if k == len(answers) - 1:
                        finished.append(_task_reward(answer) + env_reward)
                    break
            else:
                # The environment wanted another turn: stopped by agent.max_turns after it,
                # or that turn rambled until rollout.max_new_tokens cut it.
                cut_short.append(_task_reward(answers[-1]) + env_reward)
                cut_short.append(_task_reward("The word could be one of") + env_reward)
    assert finished and cut_short
    assert max(cut_short) <= min(finished), (cut_short, finished)
