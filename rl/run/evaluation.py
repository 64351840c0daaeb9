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
    (an agent's: the last assistant message of its greedy episode)."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    samples = [s for i, example in enumerate(examples) for s in groups.start(example, i, 1)]
    samples = rollout.generate(samples, greedy)
    scores = [task.score(s.response_text, examples[s.group_id]) for s in samples]
    return sum(scores) / len(scores)
