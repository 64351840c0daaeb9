"""The composed policy objective: exact over micro-batch splits, KL and IS weights as configured."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algorithms.objective import (
    loss_weights,
    policy_objective,
    zero_advantage_rows_are_inert,
)
from rl.algorithms.policy_losses import POLICY_LOSSES
from rl.config import AlgorithmConfig
from rl.types import Batch

AGGREGATIONS = [
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
MAX_LEN = 5


def _batch(num: int, length: int) -> Batch:
    torch.manual_seed(0)
    mask = (torch.rand(num, length) > 0.3).float()
    mask[-1] = 0.0  # a dummy row (as a rank short of rows runs) must not move the result
    behaviour = -torch.rand(num, length)
    return Batch(
        input_ids=torch.zeros(num, length + 1, dtype=torch.long),
        attention_mask=torch.ones(num, length + 1, dtype=torch.long),
        loss_mask=mask,
        behaviour_logprobs=behaviour,
        old_logprobs=behaviour.clone(),
        advantages=torch.randn(num, 1) * mask,
        ref_logprobs=-torch.rand(num, length),
    )


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_objective_over_micro_batches_sums_to_the_full_batch_objective(agg: str) -> None:
    cfg = AlgorithmConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01)
    batch = _batch(6, MAX_LEN)
    logprobs, entropy = -torch.rand(6, MAX_LEN), torch.rand(6, MAX_LEN)
    parts = [slice(0, 2), slice(2, 6)]
    denominator = sum(loss_weights(cfg, batch.loss_mask[rows], MAX_LEN)[1] for rows in parts)
    full, _ = policy_objective(cfg, logprobs, entropy, batch, MAX_LEN, denominator.item())
    split = sum(
        policy_objective(
            cfg, logprobs[rows], entropy[rows], batch.select(rows), MAX_LEN, denominator.item()
        )[0]
        for rows in parts
    )
    assert torch.allclose(full, split, atol=1e-6)


def test_token_mean_objective_is_the_mean_over_valid_tokens() -> None:
    cfg = AlgorithmConfig(loss_agg="token-mean")
    batch = _batch(4, MAX_LEN)
    logprobs = batch.old_logprobs.clone()  # ratio 1: the surrogate is -advantage per token
    denominator = batch.loss_mask.sum().item()
    loss, _ = policy_objective(
        cfg, logprobs, torch.zeros_like(logprobs), batch, MAX_LEN, denominator
    )
    expected = -(batch.advantages * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_importance_weights_scale_each_tokens_policy_loss() -> None:
    cfg = AlgorithmConfig(loss_agg="token-mean")
    batch = _batch(4, MAX_LEN)
    logprobs = batch.old_logprobs.clone()
    zeros = torch.zeros_like(logprobs)
    plain, _ = policy_objective(cfg, logprobs, zeros, batch, MAX_LEN, 1.0)
    batch.is_weights = torch.full_like(logprobs, 0.5)
    weighted, _ = policy_objective(cfg, logprobs, zeros, batch, MAX_LEN, 1.0)
    assert weighted.item() == pytest.approx(0.5 * plain.item(), abs=1e-6)


def test_kl_is_a_loss_term_only_when_not_in_the_reward() -> None:
    batch = _batch(3, MAX_LEN)
    logprobs, zeros = batch.old_logprobs, torch.zeros_like(batch.old_logprobs)
    without, metrics_without = policy_objective(
        AlgorithmConfig(), logprobs, zeros, batch, MAX_LEN, 1.0
    )
    with_kl, metrics_with = policy_objective(
        AlgorithmConfig(kl_coef=0.5), logprobs, zeros, batch, MAX_LEN, 1.0
    )
    in_reward, metrics_in_reward = policy_objective(
        AlgorithmConfig(kl_coef=0.5, kl_in_reward=True), logprobs, zeros, batch, MAX_LEN, 1.0
    )
    assert "kl_ref" not in metrics_without and "kl_ref" not in metrics_in_reward
    assert metrics_with["kl_ref"] > 0
    assert with_kl.item() > without.item()
    assert in_reward.item() == pytest.approx(without.item())


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES.names()))
def test_a_row_of_zero_advantage_has_no_loss_or_gradient_under_every_policy_loss(
    loss: str, dual_clip: float
) -> None:
    """What trainer.skip_zero_advantage_rows relies on, for every registered policy loss and
    with importance weights: dropping such a row changes neither loss nor gradient."""
    cfg = AlgorithmConfig(policy_loss=loss, dual_clip=dual_clip, clip_low=0.2, clip_high=0.28)
    assert zero_advantage_rows_are_inert(cfg)
    batch = _batch(4, MAX_LEN)
    batch.advantages[1:3] = 0.0
    batch.is_weights = torch.rand(4, MAX_LEN) + 0.5
    logprobs = (batch.old_logprobs + 3 * torch.randn(4, MAX_LEN)).requires_grad_()  # some clip
    entropy = torch.rand(4, MAX_LEN)
    loss_value, _ = policy_objective(cfg, logprobs, entropy, batch, MAX_LEN, 7.0)
    loss_value.backward()
    assert torch.equal(logprobs.grad[1:3], torch.zeros(2, MAX_LEN))
    assert logprobs.grad[0].abs().sum() > 0
    kept = torch.tensor([0, 3])
    kept_logprobs = logprobs.detach()[kept]
    kept_loss, _ = policy_objective(
        cfg, kept_logprobs, entropy[kept], batch.select(kept), MAX_LEN, 7.0
    )
    torch.testing.assert_close(kept_loss, loss_value.detach())


@pytest.mark.parametrize(
    ("overrides", "inert"),
    [
        ({}, True),
        ({"kl_coef": 0.1, "kl_in_reward": True}, True),
        ({"kl_coef": 0.1}, False),
        ({"entropy_coef": 0.01}, False),
    ],
)
def test_zero_advantage_rows_are_inert_only_without_kl_or_entropy_loss_terms(
    overrides: dict, inert: bool
) -> None:
    assert zero_advantage_rows_are_inert(AlgorithmConfig(**overrides)) is inert


def test_rows_with_advantage_ignores_advantages_outside_the_loss_mask() -> None:
    batch = _batch(4, MAX_LEN)
    batch.loss_mask[:] = 1.0
    batch.advantages = torch.ones(4, MAX_LEN)
    batch.advantages[1] = 0.0
    batch.loss_mask[2, 2:] = 0.0
    batch.advantages[2, :2] = 0.0  # non-zero only where no token is trained
    assert batch.rows_with_advantage().tolist() == [0, 3]


def test_cispo_gradient_is_the_clipped_weight_times_advantage_over_the_token_count() -> None:
    # clip_low 1: no lower bound on the weight, as MiniMax-M1 trains. token-mean divides the
    # summed -sg[w] A logp by the valid tokens N: d loss / d logp = -clip(r, 0, 1.28) A / N.
    cfg = AlgorithmConfig(policy_loss="cispo", loss_agg="token-mean", clip_low=1.0, clip_high=0.28)
    batch = _batch(4, MAX_LEN)
    torch.manual_seed(1)
    logprobs = (batch.old_logprobs + torch.randn(4, MAX_LEN)).requires_grad_()
    count = batch.loss_mask.sum().item()
    loss, metrics = policy_objective(cfg, logprobs, torch.zeros(4, MAX_LEN), batch, MAX_LEN, count)
    loss.backward()
    for b in range(4):
        for k in range(MAX_LEN):
            ratio = math.exp(logprobs[b, k].item() - batch.old_logprobs[b, k].item())
            expected = -min(ratio, 1.28) * batch.advantages[b, k].item() / count
            assert logprobs.grad[b, k].item() == pytest.approx(
                expected * batch.loss_mask[b, k].item(), abs=1e-7
            )
    assert 0 < metrics["clip_frac"] < 1  # clipped and unclipped tokens both checked


def test_a_forward_correction_reports_the_engine_trainer_mismatch_of_its_tokens() -> None:
    # Proximal = this forward's log-probs; k1 = mean(behav - prox), k3 = mean(e^d - 1 - d) with
    # d = prox - behav, over the loss mask.
    cfg = AlgorithmConfig(off_policy="token-tis")
    batch = _batch(4, MAX_LEN)
    torch.manual_seed(2)
    logprobs = batch.behaviour_logprobs + 0.3 * torch.randn(4, MAX_LEN)
    zeros = torch.zeros(4, MAX_LEN)
    _, metrics = policy_objective(cfg, logprobs, zeros, batch, MAX_LEN, 1.0, "token-tis")
    ds = [
        logprobs[b, k].item() - batch.behaviour_logprobs[b, k].item()
        for b in range(4)
        for k in range(MAX_LEN)
        if batch.loss_mask[b, k].item() == 1
    ]
    assert metrics["mismatch_k1"].item() == pytest.approx(-sum(ds) / len(ds), abs=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in ds) / len(ds)
    assert metrics["mismatch_k3"].item() == pytest.approx(k3, abs=1e-6)
    _, plain = policy_objective(cfg, logprobs, zeros, batch, MAX_LEN, 1.0)
    assert "mismatch_k1" not in plain  # no trainer proximal log-probs in this forward
