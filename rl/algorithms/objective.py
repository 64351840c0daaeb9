"""The policy objective the trainer minimises, composed from the registered pieces.

`Objective` is what the driver hands each trainer rank (it meets `rl.types.PolicyObjective`),
so the trainer computes the loss without knowing any algorithm by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algorithms.aggregation import LOSS_AGGREGATIONS
from rl.algorithms.kl import KL_ESTIMATORS
from rl.algorithms.masked import masked_mean
from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, mismatch_kl, proximal_from_forward
from rl.algorithms.policy_losses import POLICY_LOSSES
from rl.algorithms.router_losses import moe_metrics, router_loss, router_tally
from rl.config import AlgorithmConfig, Config
from rl.types import Batch


def loss_weights(
    cfg: AlgorithmConfig, loss_mask: torch.Tensor, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token weights [B, T-1], count) of the configured aggregation.

    The trainer sums `count` over every micro-batch on every rank to get the denominator, so
    gradient accumulation and data parallelism give the same loss as one big batch.
    """
    return LOSS_AGGREGATIONS.get(cfg.loss_agg)(loss_mask, max_response_len)


def kl_in_loss(cfg: AlgorithmConfig) -> bool:
    """Whether the loss has a KL-to-reference term (rather than the reward, or none)."""
    return cfg.kl_coef > 0 and not cfg.kl_in_reward


def zero_advantage_rows_are_inert(cfg: AlgorithmConfig) -> bool:
    """Whether a row whose advantage is 0 on every token has a loss and gradient of exactly 0.

    Every policy loss is the advantage times a finite function of the log-probs (a test pins
    this over the registry), and an off-policy weight only scales it; a KL or entropy term
    does not, nor does a mixture of experts' router loss (every token routes).
    """
    return (
        not kl_in_loss(cfg)
        and cfg.entropy_coef == 0
        and cfg.router_balance_coef == 0
        and cfg.router_z_coef == 0
    )


def policy_objective(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    batch: Batch,
    max_response_len: int,
    denominator: float,
    forward_correction: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, already divided by the global `denominator`.

    logprobs, entropy: [B, T-1] under the current policy. With `forward_correction` (an
    off-policy correction that keeps every token), the proximal policy is this forward's own
    (the batch's only optimizer step has not happened yet), so its log-probs are `logprobs`
    detached and the correction's weights are computed here, saving a separate pass.
    Returns (scalar loss, detached per-micro-batch metrics as masked means).
    """
    mask = batch.loss_mask
    old_logprobs, is_weights = batch.old_logprobs, batch.is_weights
    if forward_correction is not None:
        old_logprobs = logprobs.detach()
        is_weights, kept = OFF_POLICY_CORRECTIONS.get(forward_correction)(
            old_logprobs, batch.behaviour_logprobs, mask, cfg
        )
        # Checked on the device: a host-side check would wait for every queued kernel.
        torch._assert_async((kept == mask).all(), f"{forward_correction} dropped tokens")
    pg_loss, clipped = POLICY_LOSSES.get(cfg.policy_loss)(
        logprobs, old_logprobs, batch.advantages, mask, cfg
    )
    token_loss = pg_loss if is_weights is None else pg_loss * is_weights
    if cfg.entropy_coef:
        # Guarded so a zero coefficient skips the kernel's entropy backward entirely.
        token_loss = token_loss - cfg.entropy_coef * entropy
    metrics = {
        "pg_loss": masked_mean(pg_loss.detach(), mask),
        "clip_frac": masked_mean(clipped, mask),
        "entropy": masked_mean(entropy.detach(), mask),
        "approx_kl_old": masked_mean((old_logprobs - logprobs).detach(), mask),
    }
    if is_weights is not None:
        metrics["is_weight"] = masked_mean(is_weights, mask)
    if forward_correction is not None:
        # On this path no other pass computes the trainer's proximal log-probs; a separate
        # proximal pass reports the same as off_policy/* (rl.run.experience.prepare_batch).
        k1, k3 = mismatch_kl(old_logprobs, batch.behaviour_logprobs)
        metrics["mismatch_k1"] = masked_mean(k1, mask)
        metrics["mismatch_k3"] = masked_mean(k3, mask)
    if kl_in_loss(cfg):
        assert batch.ref_logprobs is not None, "a KL loss term needs reference log-probs"
        kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logprobs, batch.ref_logprobs)
        token_loss = token_loss + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    weights, _ = loss_weights(cfg, mask, max_response_len)
    loss = (token_loss * weights).sum() / denominator
    return loss, metrics


@dataclass(frozen=True)
class Objective:
    """The configured policy objective of one run (`rl.types.PolicyObjective`)."""

    cfg: AlgorithmConfig
    max_response_len: int  # rollout.max_new_tokens: what seq-mean-token-sum-norm divides by
    forward_correction: str | None  # the off-policy correction taken from the training forward

    @classmethod
    def from_config(cls, cfg: Config) -> Objective:
        return cls(
            cfg.algorithm,
            cfg.rollout.max_new_tokens,
            cfg.algorithm.off_policy if proximal_from_forward(cfg) else None,
        )

    @property
    def kl_in_loss(self) -> bool:
        return kl_in_loss(self.cfg)

    @property
    def zero_advantage_rows_are_inert(self) -> bool:
        return zero_advantage_rows_are_inert(self.cfg)

    def token_count(self, batch: Batch) -> float:
        return loss_weights(self.cfg, batch.loss_mask, self.max_response_len)[1].item()

    def router_loss(
        self, logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        return router_loss(logits, experts, mask, self.cfg)

    def router_tally(
        self, logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        return router_tally(logits, experts, mask)

    def router_metrics(self, tally: torch.Tensor) -> dict[str, float]:
        return moe_metrics(tally)

    def loss(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, batch: Batch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_objective(
            self.cfg,
            logprobs,
            entropy,
            batch,
            self.max_response_len,
            denominator,
            self.forward_correction,
        )
