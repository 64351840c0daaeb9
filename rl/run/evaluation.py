"""Held-out evaluation: greedy accuracy of the current rollout policy."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rl.cluster.rollout_replicas import RolloutReplicas
from rl.config import Config
from rl.data.prompts import encode_prompt
from rl.data.tasks import Task
from rl.types import SamplingParams


def evaluate(
    rollout: RolloutReplicas,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[dict],
    cfg: Config,
) -> float:
    """Fraction of `examples` whose greedy (temperature 0) response the task verifier accepts."""
    prompts = [encode_prompt(tokenizer, example["prompt"]) for example in examples]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    samples = rollout.generate(prompts, greedy)
    scores = [task.score(s.response_text, examples[s.group_id]) for s in samples]
    return sum(scores) / len(scores)
