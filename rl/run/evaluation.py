"""Held-out evaluation: greedy accuracy of the current rollout policy."""

from __future__ import annotations

from rl.cluster.rollout_replicas import RolloutReplicas
from rl.config import Config
from rl.data.tasks import Task
from rl.run.groups import GroupStarter
from rl.types import SamplingParams


def evaluate(
    rollout: RolloutReplicas,
    groups: GroupStarter,
    task: Task,
    examples: list[dict],
    cfg: Config,
) -> float:
    """Fraction of `examples` whose greedy (temperature 0) response the task verifier accepts
    (an agent's: the last assistant message of its greedy episode); for a task that
    `scores_episodes`, the mean reward of the greedy episodes."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    samples = [s for i, example in enumerate(examples) for s in groups.start(example, i, 1)]
    samples = rollout.generate(samples, greedy)
    if task.scores_episodes:
        scores = [0.0 if s.episode is None else s.episode.reward for s in samples]
    else:
        scores = [task.score(s.response_text, examples[s.group_id]) for s in samples]
    return sum(scores) / len(scores)
