"""Scores of samples cut short by a limit (`reward.cap_truncated`).

A response or episode cut at `rollout.max_new_tokens` (finish_reason "length"), or an episode
stopped by `agent.max_turns` while its environment still expected turns, never finished: what
it scores is whatever the reward made of where it stopped. A reward that punishes a wrong
answer then pays running into the limit better than answering, and a policy learns to do
that. So such a sample scores no higher than the lowest finished sample of its group. A group
in which nothing finished keeps its scores: there is no finished answer to compare with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl.types import Sample


def is_truncated(sample: Sample) -> bool:
    """Whether `sample` ended at a limit rather than by its own end (or its environment's):
    its response reached `rollout.max_new_tokens`, or its episode reached `agent.max_turns`."""
    return sample.finish_reason == "length" or (
        sample.episode is not None and sample.episode.max_turns_reached
    )


def cap_truncated(scores: Tensor, truncated: Tensor) -> Tensor:
    """One group's scores [G] with each truncated sample's (`truncated` [G] bool) lowered to
    the lowest score of the group's finished samples where it was higher; unchanged when no
    sample finished."""
    assert scores.shape == truncated.shape and scores.dim() == 1, (scores.shape, truncated.shape)
    finished = scores[~truncated]
    if finished.numel() == 0:
        return scores
    return torch.where(truncated, scores.clamp(max=finished.min()), scores)
