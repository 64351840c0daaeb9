"""The policy objective the trainer minimises, composed from the registered pieces."""

from __future__ import annotations

import torch

from rl.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, masked_mean
from rl.config import AlgorithmConfig
from rl.types import Batch


def loss_weights(
    cfg: AlgorithmConfig, loss_mask: torch.Tensor, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token weights [B, T-1], count) of the configured aggregation.

    The trainer sums `count` over every micro-batch on every rank to get the denominator, so
    gradient accumulation and data parallelism give the same loss as one big batch.
    """
    return LOSS_AGGREGATIONS.get(cfg.loss_agg)(loss_mask, max_response_len)


def policy_objective(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    batch: Batch,
    max_response_len: int,
    denominator: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, already divided by the global `denominator`.

    logprobs, entropy: [B, T-1] under the current policy. Returns (scalar loss, detached
    per-micro-batch metrics as masked means).
    """
    mask = batch.loss_mask
    pg_loss, clipped = POLICY_LOSSES.get(cfg.policy_loss)(
        logprobs, batch.old_logprobs, batch.advantages, mask, cfg
    )
    token_loss = pg_loss if batch.is_weights is None else pg_loss * batch.is_weights
    if cfg.entropy_coef:
        # Guarded so a zero coefficient skips the kernel's entropy backward entirely.
        token_loss = token_loss - cfg.entropy_coef * entropy
    metrics = {
        "pg_loss": masked_mean(pg_loss.detach(), mask),
        "clip_frac": masked_mean(clipped, mask),
        "entropy": masked_mean(entropy.detach(), mask),
        "approx_kl_old": masked_mean((batch.old_logprobs - logprobs).detach(), mask),
    }
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        assert batch.ref_logprobs is not None, "a KL loss term needs reference log-probs"
        kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logprobs, batch.ref_logprobs)
        token_loss = token_loss + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    weights, _ = loss_weights(cfg, mask, max_response_len)
    loss = (token_loss * weights).sum() / denominator
    return loss, metrics
