"""Masked tensor helpers that every algorithm shares.

Conventions of rl/algorithms: B sequences ordered group by group (G = cfg.group_size consecutive
rows answer the same prompt); T1 = T-1 target positions, aligned to targets as in
`rl.types.Batch`; `mask` [B, T1] is 1.0 on response tokens. Per-token outputs are 0 outside
the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped before exp(): exp(20) ~ 4.9e8 is finite in float32 and bf16 and far
# beyond any ratio that still carries information, so one outlier token cannot make inf/NaN.
LOG_RATIO_LIMIT = 20.0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where mask is 1, over all dims -> scalar (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) over the batch's valid tokens, [B, T1] -> [B, T1].

    Population variance, as OpenRLHF. eps keeps a batch whose valid values are all equal (std 0)
    at its centred values, i.e. 0, instead of dividing rounding noise up. 0 outside the mask.
    """
    centred = (values - masked_mean(values, mask)) * mask
    return centred * (masked_mean(centred**2, mask) + eps).rsqrt()


def by_group(scores: Tensor, group_size: int) -> Tensor:
    """[B] -> [B // G, G], refusing a batch that is not a whole number of groups."""
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} sequences do not split into groups of {group_size}")
    return scores.view(-1, group_size)


def sequence_scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's total reward over its response tokens: [B, T1] -> [B]."""
    return (token_rewards * mask).sum(dim=1)


def at_last_token(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Place per-sequence values [B] on each row's last response token -> [B, T1], 0 elsewhere."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    last = (mask * positions).argmax(dim=1, keepdim=True)
    placed = torch.zeros_like(mask).scatter(1, last, per_sequence.unsqueeze(1).to(mask.dtype))
    return placed * mask  # rows with an empty mask get nothing


def clamped_exp(log_ratio: Tensor) -> Tensor:
    """exp(log_ratio) with log_ratio clamped to +-LOG_RATIO_LIMIT first."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
