"""KL estimators between the policy and the reference, per token, and the adaptive KL
coefficient of a KL reward penalty."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl.algorithms.masked import LOG_RATIO_LIMIT
from rl.config.registry import Registry

KLFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class KLTraits:
    # The divergence whose gradient the estimator's expected gradient follows as a loss term
    # (samples from pi, differentiated through logprobs); "" when its expected gradient is
    # zero, so as a loss term it only adds noise.
    loss_gradient: str = ""


KL_ESTIMATORS: Registry[KLFn, KLTraits] = Registry("KL estimator", KLTraits)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log(pi/ref) = logprobs - ref_logprobs, [B, T1]; unbiased, high variance, can be < 0."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2", loss_gradient="KL(pi||ref)")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 (logprobs - ref_logprobs)^2, [B, T1]; biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3", loss_gradient="KL(ref||pi)")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(x) - 1 - x with x = ref_logprobs - logprobs, [B, T1]; unbiased and >= 0.

    x is clamped to [-20, 20] so one outlier token cannot overflow exp().
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - 1.0 - log_ratio


def adaptive_kl_coef(
    coef: float, observed_kl: float, target: float, num_samples: int, horizon: int
) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): coef (1 + e num_samples / horizon) with the
    proportional error e = clip(observed_kl / target - 1, -0.2, 0.2)."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)
