"""RL algorithms as small pure functions over tensors, chosen by name through registries.

Shapes: G responses per prompt, P prompts, B = P*G sequences, T-1 target positions.
Per-token tensors are aligned to targets (see `rl.types.Batch`).
"""

from __future__ import annotations

import torch

from rl.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")


@ADVANTAGES.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages. rewards [B] ordered group by group -> advantages [B].

    A group whose responses all scored the same gets advantage 0 (no signal, no noise).
    """
    assert rewards.ndim == 1 and rewards.numel() % group_size == 0
    grouped = rewards.view(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.view(-1)


@POLICY_LOSSES.register("clipped")
def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, per token. All inputs [B, T-1] -> (loss [B, T-1], clipped [B, T-1]).

    `clipped` is 1.0 where the clipped branch was taken (for the clip-fraction metric).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Naive estimator log(pi/ref), per token [B, T-1]; unbiased, high variance, can be < 0."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = r - 1 - log r with r = ref/pi, per token [B, T-1]; unbiased and >= 0.

    The log-ratio is clamped so one outlier token cannot overflow exp().
    """
    log_ratio = torch.clamp(ref_logprobs - logprobs, -20.0, 20.0)
    return torch.exp(log_ratio) - 1.0 - log_ratio


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """Each valid token counts once: weights [B, T-1] whose global sum is the token count."""
    return mask


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """Each sequence counts once (tokens averaged within it): weights summing to 1 per row."""
    return mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where mask is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
