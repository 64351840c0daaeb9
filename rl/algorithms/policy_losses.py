"""Policy losses per token: log-probs under the current and the old policy, advantages ->
(loss, where a clip bound decided), all [B, T1].

Conventions: rl/algorithms/masked.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl.algorithms.masked import LOG_RATIO_LIMIT, clamped_exp
from rl.config import AlgorithmConfig
from rl.config.registry import Registry

PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PolicyLossTraits:
    # The loss aggregation its objective is defined with ("" = any): GSPO's is the mean over
    # sequences of each sequence's token mean.
    aggregation: str = ""


POLICY_LOSSES: Registry[PolicyLossFn, PolicyLossTraits] = Registry("policy loss", PolicyLossTraits)


def _clip(ratio: Tensor, advantages: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) and where the clipped branch won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("clipped")
def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """PPO clip per token: loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    r = exp(logprobs - old_logprobs); clip_high > clip_low is DAPO's clip-higher. Dual-clip
    (Ye et al. 2020), cfg.dual_clip = c > 1: where A < 0, loss = min(loss, -A c), bounding what
    a huge ratio can cost. All inputs [B, T1] -> (loss, clipped: 1.0 where a bound decided).
    """
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    loss, active = _clip(clamped_exp(logprobs - old_logprobs), advantages, cfg)
    if cfg.dual_clip:
        bound = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        active = active | dual
    return loss * mask, active.float() * mask


@POLICY_LOSSES.register("gspo", aggregation="seq-mean-token-mean")
def gspo_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """GSPO: sequence ratio s_i = exp(mean_t (logprobs - old_logprobs)) over i's response.

    Token form s_{i,t} = sg[s_i] exp(logprobs - sg[logprobs]): the value is s_i on every token,
    d s_{i,t} / d logprobs_t = s_i, so per-token gradients flow. loss = max(-A s, -A clip(s,
    1 - clip_low, 1 + clip_high)) (GSPO uses clip ranges ~1e-3). All [B, T1] -> (loss, clipped).
    """
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    seq_log_ratio = seq_log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    loss, active = _clip(torch.exp(seq_log_ratio + logprobs - logprobs.detach()), advantages, cfg)
    return loss * mask, active.float() * mask


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): loss = -sg[clip(r, 1 - clip_low, 1 + clip_high)]
    A logprobs, r = exp(logprobs - old_logprobs).

    The clip bounds the importance weight, not the update: the weight is detached, so every
    token's gradient -clip(r) A flows through its log-prob and none is zeroed as PPO's clip
    zeroes it. All [B, T1] -> (loss, clipped: 1.0 where a bound set the weight).
    """
    ratio = clamped_exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return -weight * advantages * logprobs * mask, (weight != ratio).float() * mask
