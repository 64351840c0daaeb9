"""Off-policy corrections: weigh the loss by pi_proximal / pi_behaviour (the trainer's old policy
over the rollout engine's sampling policy); weights carry no gradient and are 0 outside the
returned mask.

Conventions: rl/algorithms/masked.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl.algorithms.kl import kl_k1, kl_k3
from rl.algorithms.masked import clamped_exp, masked_mean
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


def mismatch_kl(proximal_logprobs: Tensor, behaviour_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token estimates of KL(engine || trainer) on tokens the engine sampled [B, T1]:
    k1 = behav - prox and Schulman's k3 = exp(d) - 1 - d with d = prox - behav (>= 0)."""
    proximal, behaviour = proximal_logprobs.detach(), behaviour_logprobs.detach()
    return kl_k1(behaviour, proximal), kl_k3(behaviour, proximal)


def mismatch_metrics(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    kept: Tensor,
    ages: Tensor | None,
) -> dict[str, float]:
    """The step's off_policy/* metrics: the engine's against the trainer's log-probs on the
    response tokens of `mask` [B, T1] (mismatch_k1, mismatch_k3: `mismatch_kl`'s means), and
    what the correction kept of them, `kept` [B, T1] (kept_token_frac; kept_seq_frac: the
    share of non-empty rows it dropped no token of). With `ages` [B] (each row's versions
    behind the trained policy), each again per age as `<key>_age<a>`: under overlap a step
    mixes versions, and the mismatch of a stale row includes the policy's own change."""
    k1, k3 = mismatch_kl(proximal_logprobs, behaviour_logprobs)
    groups = {"": torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)}
    if ages is not None:
        groups |= {f"_age{age}": ages == age for age in sorted(set(ages.tolist()))}
    metrics = {}
    for suffix, rows in groups.items():
        row_mask, row_kept = mask[rows], kept[rows]
        lengths = row_mask.sum(dim=1)
        whole = (row_kept.sum(dim=1) == lengths) & (lengths > 0)
        metrics |= {
            f"off_policy/mismatch_k1{suffix}": masked_mean(k1[rows], row_mask).item(),
            f"off_policy/mismatch_k3{suffix}": masked_mean(k3[rows], row_mask).item(),
            f"off_policy/kept_token_frac{suffix}": (
                row_kept.sum() / lengths.sum().clamp(min=1.0)
            ).item(),
            f"off_policy/kept_seq_frac{suffix}": (
                whole.sum() / (lengths > 0).sum().clamp(min=1)
            ).item(),
        }
    return metrics


def _log_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    return (proximal - behaviour).detach() * mask


def _within(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(ratio, the mask kept): tokens (log_ratio [B, T1]) or sequences ([B, 1]) whose ratio
    exp(log_ratio) is in [low, high]."""
    ratio = clamped_exp(log_ratio)
    return ratio, mask * ((ratio >= low) & (ratio <= high))


def _masked_is(log_ratio: Tensor, mask: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Keep tokens (log_ratio [B, T1]) or sequences ([B, 1]) whose ratio is in [is_low, is_high]."""
    ratio, keep = _within(log_ratio, mask, cfg.is_low, cfg.is_high)
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


# IcePop (Ring-1T) is this correction under its paper's name: M(r; alpha, beta) = r inside
# [alpha, beta] = [is_low, is_high], else 0 and the token leaves the loss.
@OFF_POLICY_CORRECTIONS.register("icepop", keeps_mask=False)
@OFF_POLICY_CORRECTIONS.register("token-mis", keeps_mask=False)
def token_mis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Masked IS per token (IcePop): r = exp(prox - behav); tokens with r outside [is_low,
    is_high] leave the mask, the kept ones get w = r. Returns (w, mask), both [B, T1]."""
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


@OFF_POLICY_CORRECTIONS.register("geo-rs", keeps_mask=False)
def geo_rs(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Geometric-mean rejection per sequence: g_i = exp(mean_t (prox - behav)) over i's
    response; sequences with g_i outside [geo_low, geo_high] leave the mask whole, the kept ones
    get w = 1 (a filter, no reweighting; the mean keeps the band independent of length).
    Returns (w, mask), both [B, T1]."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(dim=1, keepdim=True)
    _, keep = _within(log_ratio / lengths, mask, cfg.geo_low, cfg.geo_high)
    return keep.clone(), keep


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
