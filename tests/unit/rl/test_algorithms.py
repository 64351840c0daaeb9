"""GRPO advantages, the clipped surrogate, KL estimators and the composed objective."""

from __future__ import annotations

import pytest
import torch

from rl.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, grpo_advantages, kl_k3
from rl.config import AlgorithmConfig
from rl.loss import loss_weights, policy_objective
from rl.types import Batch


def test_grpo_advantages_are_centred_and_scaled_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, group_size=4)
    first = adv[:4]
    assert first.sum().abs() < 1e-6
    assert torch.allclose(first.std(unbiased=True), torch.tensor(1.0), atol=1e-4)
    assert first[0] > 0 > first[1]
    # A group that all scored alike carries no signal.
    assert torch.equal(adv[4:], torch.zeros(4))


def test_grpo_advantages_without_std_are_only_centred() -> None:
    adv = grpo_advantages(torch.tensor([2.0, 0.0]), group_size=2, normalize_std=False)
    assert torch.equal(adv, torch.tensor([1.0, -1.0]))


def test_clipped_surrogate_stops_gradient_beyond_the_clip() -> None:
    old = torch.zeros(4)
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, clipped = POLICY_LOSSES.get("clipped")(logprobs, old, adv, 0.2, 0.2)
    loss.sum().backward()
    # ratio 1.5 with A>0 and ratio 0.5 with A<0 are clipped: no gradient; the others move.
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert logprobs.grad[0] == 0 and logprobs.grad[1] == 0
    assert logprobs.grad[2] < 0 and logprobs.grad[3] < 0


def test_k3_is_zero_at_equality_and_positive_elsewhere() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.allclose(kl_k3(logprobs, logprobs), torch.zeros(3))
    assert (kl_k3(logprobs, logprobs + torch.tensor([0.3, -0.3, 1.0])) > 0).all()


def test_registries_list_valid_names_on_a_typo() -> None:
    with pytest.raises(ValueError, match="valid: k1, k3"):
        KL_ESTIMATORS.get("k2")
    with pytest.raises(ValueError, match="valid: grpo"):
        ADVANTAGES.get("gae")


def _batch(num: int, length: int) -> Batch:
    torch.manual_seed(0)
    mask = (torch.rand(num, length) > 0.3).float()
    return Batch(
        input_ids=torch.zeros(num, length + 1, dtype=torch.long),
        attention_mask=torch.ones(num, length + 1, dtype=torch.long),
        loss_mask=mask,
        old_logprobs=-torch.rand(num, length),
        advantages=torch.randn(num, 1) * mask,
        ref_logprobs=-torch.rand(num, length),
    )


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_objective_over_micro_batches_sums_to_the_full_batch_objective(agg: str) -> None:
    cfg = AlgorithmConfig(loss_agg=agg, kl_coef=0.1)
    batch = _batch(6, 5)
    logprobs, entropy = -torch.rand(6, 5), torch.rand(6, 5)
    denominator = loss_weights(cfg, batch.loss_mask).sum().item()
    full, _ = policy_objective(cfg, logprobs, entropy, batch, denominator)
    parts = [
        policy_objective(cfg, logprobs[rows], entropy[rows], batch.select(rows), denominator)[0]
        for rows in (slice(0, 2), slice(2, 6))
    ]
    assert torch.allclose(full, sum(parts), atol=1e-6)


def test_objective_reports_kl_only_when_it_is_used() -> None:
    batch = _batch(2, 3)
    _, without = policy_objective(
        AlgorithmConfig(), batch.old_logprobs, batch.old_logprobs, batch, 1.0
    )
    _, with_kl = policy_objective(
        AlgorithmConfig(kl_coef=0.5), batch.old_logprobs, batch.old_logprobs, batch, 1.0
    )
    assert "kl_ref" not in without
    assert with_kl["kl_ref"].item() > 0
    assert without["clip_frac"].item() == 0.0
