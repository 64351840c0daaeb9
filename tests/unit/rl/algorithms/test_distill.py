"""rl.algorithms.distill: on-policy distillation's per-token term against its formula, and its
policy gradient against the exact gradient of the reverse KL it estimates."""

from __future__ import annotations

import math

import torch

from rl.algorithms.distill import (
    DISTILL_LOSSES,
    reverse_kl,
    reverse_kl_advantage,
    with_distillation,
)
from rl.algorithms.policy_losses import POLICY_LOSSES
from rl.config import AlgorithmConfig
from tests.unit.rl.algorithms.tensors import GARBAGE, close, t


def test_reverse_kl_advantage_is_teacher_minus_behaviour_on_sampled_tokens_only() -> None:
    # Row 0: two sampled tokens, then padding; row 1: a sampled token, an inserted observation
    # token (an agent's, mask 0) and a sampled one.
    behaviour = t([[-0.5, -2.0, GARBAGE], [-1.0, GARBAGE, -0.1]])
    teacher = t([[-0.1, -3.0, GARBAGE], [-1.0, -GARBAGE, -2.1]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    expected = [
        [-(-0.5 - -0.1), -(-2.0 - -3.0), 0.0],
        [-(-1.0 - -1.0), 0.0, -(-0.1 - -2.1)],
    ]
    assert DISTILL_LOSSES.get("reverse_kl") is reverse_kl_advantage
    assert close(reverse_kl_advantage(behaviour, teacher, mask), expected)
    # The k1 estimate of KL(student || teacher): the mean of behaviour - teacher over the four
    # sampled tokens.
    kl = reverse_kl(behaviour, teacher, mask).item()
    assert math.isclose(kl, (-0.4 + 1.0 + 0.0 + 2.0) / 4, rel_tol=1e-6)


def test_the_task_advantage_gets_the_coefficient_times_the_term() -> None:
    task = t([[0.5, 0.5, 0.0], [-0.5, 0.0, -0.5]])
    behaviour = t([[-0.5, -2.0, GARBAGE], [-1.0, GARBAGE, -0.1]])
    teacher = t([[-0.1, -3.0, GARBAGE], [-1.0, -GARBAGE, -2.1]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    cfg = AlgorithmConfig(distill_coef=0.25)
    mixed = with_distillation(task, behaviour, teacher, mask, cfg)
    assert close(mixed, [[0.5 + 0.25 * 0.4, 0.5 - 0.25, 0.0], [-0.5, 0.0, -0.5 - 0.25 * 2.0]])


def test_its_expected_policy_gradient_is_minus_the_gradient_of_the_reverse_kl() -> None:
    """The term used as PPO's advantage at ratio 1 (on-policy), averaged over every token y the
    student could sample at one state with its probability p(y), has the gradient of
    KL(p || q) = sum_y p(y) (log p(y) - log q(y)), computed here in closed form: minimising the
    loss moves the student towards the teacher q."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, generator=gen, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    logp = torch.log_softmax(logits, dim=0)

    # Every token of the vocabulary as a one-token sample of its own (a row each).
    sampled = logp.unsqueeze(1)
    behaviour = sampled.detach()  # on-policy: the sampler is the current policy
    mask = torch.ones_like(sampled)
    advantages = reverse_kl_advantage(behaviour, teacher.unsqueeze(1), mask)
    token_loss, _ = POLICY_LOSSES.get("clipped")(
        sampled, behaviour, advantages, mask, AlgorithmConfig()
    )
    expected_loss = (logp.exp().detach() * token_loss[:, 0]).sum()
    (estimator,) = torch.autograd.grad(expected_loss, logits, retain_graph=True)

    kl = (logp.exp() * (logp - teacher)).sum()
    (exact,) = torch.autograd.grad(kl, logits)
    assert torch.allclose(estimator, exact, atol=1e-6), (estimator, exact)
    assert kl.item() > 0.01  # the two distributions differ: the gradient is not trivially 0
