"""The PPO critic's loss."""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> Tensor:
    """Clipped critic loss per token, [B, T1]: 0.5 max((v - R)^2, (v_clip - R)^2) with
    v_clip = old + clamp(v - old, -clip, clip); plain 0.5 (v - R)^2 when clip <= 0. 0 off-mask."""
    loss = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss * mask
