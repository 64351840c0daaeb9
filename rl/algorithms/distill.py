"""On-policy distillation: a frozen teacher's log-probs of the student's own sampled tokens as
a dense, per-token advantage term (algorithm.distill_coef, algorithm.distill_loss).

Conventions: rl/algorithms/masked.py. Each term maps the behaviour log-probs (the policy that
sampled each token, recorded by the engine) and the teacher's log-probs of the same tokens,
both [B, T1] at the sampling temperature, to a per-token advantage [B, T1], 0 outside `mask`;
the batch's advantage is the task estimator's plus `distill_coef` times it
(`with_distillation`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rl.algorithms.masked import masked_mean
from rl.config import AlgorithmConfig
from rl.config.registry import NoTraits, Registry

DistillFn = Callable[[Tensor, Tensor, Tensor], Tensor]

DISTILL_LOSSES: Registry[DistillFn, NoTraits] = Registry("distillation term")


def reverse_kl(behaviour_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The sampled-token estimate of KL(student || teacher): mean over `mask`'s tokens of
    behaviour_logprobs - teacher_logprobs (Schulman's k1; the tokens are the student's own
    samples). A scalar, what `distill/reverse_kl` reports."""
    return masked_mean(behaviour_logprobs - teacher_logprobs, mask)


@DISTILL_LOSSES.register("reverse_kl")
def reverse_kl_advantage(
    behaviour_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor
) -> Tensor:
    """A_t = -(log pi_behav(y_t) - log pi_teacher(y_t)) on every sampled token y_t, [B, T1].

    The negative per-token reverse KL as a reward without discounting (Thinking Machines'
    on-policy distillation; verl's PG OPD with k1; slime's --use-opd): its policy gradient
    E[A_t grad log pi(y_t)] is -grad KL(pi || pi_teacher) at each visited state, so the student
    moves its own samples towards what the teacher would have said there.
    """
    return (teacher_logprobs - behaviour_logprobs) * mask


def with_distillation(
    advantages: Tensor,
    behaviour_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
) -> Tensor:
    """The task `advantages` [B, T1] plus distill_coef times the configured term, added after
    the task estimator (its group baseline and any whitening), as slime adds its OPD term."""
    term = DISTILL_LOSSES.get(cfg.distill_loss)(behaviour_logprobs, teacher_logprobs, mask)
    return advantages + cfg.distill_coef * term
