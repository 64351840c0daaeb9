"""Off-policy corrections: weigh the loss by pi_proximal / pi_behaviour (the trainer's old policy
over the rollout engine's sampling policy); weights carry no gradient and are 0 outside the
returned mask.

Conventions: rl/algorithms/masked.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rl.algorithms.masked import clamped_exp
from rl.config import AlgorithmConfig, Config
from rl.config.registry import Registry

CorrectionFn = Callable[[Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class CorrectionTraits:
    needs_proximal: bool = True  # it weighs by the proximal log-probs (all but "none")
    keeps_mask: bool = True  # it never drops tokens from the loss mask


OFF_POLICY_CORRECTIONS: Registry[CorrectionFn, CorrectionTraits] = Registry(
    "off-policy correction", CorrectionTraits
)


def proximal_from_forward(cfg: Config) -> bool:
    """Whether the trainer takes the proximal log-probs from its training forward itself,
    detached, instead of a separate pass over the batch: exact when the batch gets one
    optimizer step (that forward's weights are the proximal policy), nothing needs them
    before training (a KL reward penalty does) and the correction keeps every token."""
    algo, trainer = cfg.algorithm, cfg.trainer
    traits = OFF_POLICY_CORRECTIONS.traits(algo.off_policy)
    return (
        traits.needs_proximal
        and traits.keeps_mask
        and not algo.recompute_old_logprobs
        and trainer.num_mini_batches == 1
        and trainer.num_epochs == 1
        and not (algo.kl_coef > 0 and algo.kl_in_reward)
    )


def recomputes_old_logprobs(cfg: Config) -> bool:
    """Whether a separate trainer pass recomputes the proximal log-probs before training
    (asked for, or needed by a correction that the training forward cannot supply)."""
    algo = cfg.algorithm
    return algo.recompute_old_logprobs or (
        OFF_POLICY_CORRECTIONS.traits(algo.off_policy).needs_proximal
        and not proximal_from_forward(cfg)
    )


def _log_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    return (proximal - behaviour).detach() * mask


def _masked_is(log_ratio: Tensor, mask: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Keep tokens (log_ratio [B, T1]) or sequences ([B, 1]) whose ratio is in [is_low, is_high]."""
    ratio = clamped_exp(log_ratio)
    keep = mask * ((ratio >= cfg.is_low) & (ratio <= cfg.is_high))
    return ratio * keep, keep


@OFF_POLICY_CORRECTIONS.register("none", needs_proximal=False)
def no_correction(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """No correction: weights = 1 on the mask [B, T1], mask unchanged."""
    return mask.clone(), mask


@OFF_POLICY_CORRECTIONS.register("token-tis")
def token_tis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Truncated IS per token: w = min(exp(prox - behav), is_cap) [B, T1], mask unchanged."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    ratio = clamped_exp(log_ratio)
    return ratio.clamp(max=cfg.is_cap) * mask, mask


@OFF_POLICY_CORRECTIONS.register("token-mis", keeps_mask=False)
def token_mis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Masked IS per token: r = exp(prox - behav); tokens with r outside [is_low, is_high] leave
    the mask, the kept ones get w = r. Returns (w, mask), both [B, T1]."""
    return _masked_is(_log_ratio(proximal_logprobs, behaviour_logprobs, mask), mask, cfg)


@OFF_POLICY_CORRECTIONS.register("seq-tis")
def seq_tis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Truncated IS per sequence: w_i = min(exp(sum_t (prox - behav)), is_cap) on every token of
    sequence i. Returns (w, mask unchanged), both [B, T1]."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(dim=1, keepdim=True)
    ratio = clamped_exp(log_ratio)
    return ratio.clamp(max=cfg.is_cap) * mask, mask


@OFF_POLICY_CORRECTIONS.register("seq-mis", keeps_mask=False)
def seq_mis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Masked IS per sequence: r_i = exp(sum_t (prox - behav)); sequences with r_i outside
    [is_low, is_high] leave the mask whole, the kept ones get w = r_i. Returns (w, mask) [B, T1]."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(dim=1, keepdim=True)
    return _masked_is(log_ratio, mask, cfg)


@OFF_POLICY_CORRECTIONS.register("decoupled")
def decoupled(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022): untruncated w = exp(prox - behav) [B, T1], mask kept.

    The PPO ratio is then pi / pi_proximal, so the trust region is around the proximal policy
    (the recomputed old log-probs), while w corrects for sampling from the behaviour policy.
    """
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    return clamped_exp(log_ratio) * mask, mask
