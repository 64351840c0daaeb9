"""DAPO's pieces outside the loss: soft overlong punishment and dynamic sampling."""

from __future__ import annotations

import torch
from torch import Tensor

from rl.algorithms.masked import by_group


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong punishment per sequence, [B] -> [B] float: 0 up to max_len - buffer,
    then linear down to -penalty at max_len (and no lower); all 0 when buffer == 0."""
    if buffer < 0:
        raise ValueError(f"overlong buffer must be >= 0, got {buffer}")
    lengths = response_lengths.float()
    if buffer == 0:
        return torch.zeros_like(lengths)
    excess = lengths - (max_len - buffer)
    return (-excess / buffer * penalty).clamp(min=-penalty, max=0.0)


def dynamic_sampling_keep(scores: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: scores [B] -> [B // G] bool, True for groups whose scores are not
    all equal (the others give GRPO no gradient). A group of one is never kept."""
    grouped = by_group(scores, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
