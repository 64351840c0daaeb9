"""rl.algorithms, advantage estimators: every one against values worked out by hand from its
formula, with masking, equal groups, groups of one and responses at different columns."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algorithms.advantages import ADVANTAGES
from rl.algorithms.masked import at_last_token
from rl.config import AlgorithmConfig
from tests.unit.rl.algorithms.tensors import GARBAGE, close, t


def last_token_rewards(scores: list[float], mask: torch.Tensor) -> torch.Tensor:
    """Each score on its row's last response token, GARBAGE on every non-response token."""
    rewards = torch.where(mask.bool(), 0.0, GARBAGE)
    for row, score in enumerate(scores):
        rewards[row, int(mask[row].nonzero().max())] = score
    return rewards


# ---------------------------------------------------------------- advantages


def test_grpo_normalises_by_group_and_broadcasts_over_the_response_only() -> None:
    # Rows of lengths 2, 1, 3, 2 at different columns; scores [1, 0, 0, 1] in one group:
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) -> A = +-0.5 / (sqrt(1/3) + 1e-6).
    mask = t([[1, 1, 0], [0, 0, 1], [1, 1, 1], [0, 1, 1]])
    rewards = last_token_rewards([1, 0, 0, 1], mask)
    adv, returns = ADVANTAGES.get("grpo")(rewards, mask, AlgorithmConfig(group_size=4))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert close(adv, [[a, a, 0], [0, 0, -a], [-a, -a, -a], [0, a, a]])
    assert torch.equal(returns, adv)


def test_grpo_without_std_is_only_centred_dr_grpo() -> None:
    mask = t([[1, 1], [1, 0]])
    cfg = AlgorithmConfig(group_size=2, normalize_std=False)
    adv, _ = ADVANTAGES.get("grpo")(last_token_rewards([2, 0], mask), mask, cfg)
    assert close(adv, [[1, 1], [-1, 0]])


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_estimators_give_zero_to_equal_groups_and_groups_of_one(name: str) -> None:
    mask = t([[1, 1], [1, 0], [0, 1], [1, 1]])
    rewards = last_token_rewards([1, 1, 0, 2], mask)
    adv, _ = ADVANTAGES.get(name)(rewards, mask, AlgorithmConfig(group_size=2))
    assert adv[:2].abs().max() == 0  # the first group scored 1, 1
    assert adv[2:].abs().max() > 0
    lone, _ = ADVANTAGES.get(name)(rewards, mask, AlgorithmConfig(group_size=1))
    assert torch.equal(lone, torch.zeros(4, 2))


def test_rloo_subtracts_the_mean_of_the_other_responses() -> None:
    # Group [1, 0, 0, 1]: 1 - 1/3, 0 - 2/3, ...; group [3, 1]: 3 - 1, 1 - 3.
    mask = t([[1, 1], [0, 1], [1, 0], [1, 1]])
    cfg = AlgorithmConfig(group_size=4)
    adv, returns = ADVANTAGES.get("rloo")(last_token_rewards([1, 0, 0, 1], mask), mask, cfg)
    b = 2 / 3
    assert close(adv, [[b, b], [0, -b], [-b, 0], [b, b]])
    assert torch.equal(returns, adv)
    mask2 = t([[1], [1]])
    adv2, _ = ADVANTAGES.get("rloo")(t([[3], [1]]), mask2, AlgorithmConfig(group_size=2))
    assert close(adv2, [[2], [-2]])


def test_group_estimators_refuse_a_batch_that_is_not_whole_groups() -> None:
    with pytest.raises(ValueError, match="groups of 2"):
        ADVANTAGES.get("grpo")(
            t([[1], [0], [1]]), t([[1], [1], [1]]), AlgorithmConfig(group_size=2)
        )


def test_reinforce_pp_discounts_within_the_response_then_whitens_over_the_batch() -> None:
    # gamma 0.5. Row 0, response at columns 1..3, rewards [1, 0, 2]: G = [1.5, 1, 2].
    # Row 1, response at columns 0..1, rewards [0, 4]: G = [2, 4].
    # Valid G: mean 10.5 / 5 = 2.1, deviations [-0.6, -1.1, -0.1, -0.1, 1.9], var 5.2 / 5.
    mask = t([[0, 1, 1, 1], [1, 1, 0, 0]])
    rewards = t([[GARBAGE, 1, 0, 2], [0, 4, GARBAGE, 0]])
    adv, returns = ADVANTAGES.get("reinforce_pp")(rewards, mask, AlgorithmConfig(gamma=0.5))
    assert close(returns, [[0, 1.5, 1, 2], [2, 4, 0, 0]])
    s = math.sqrt(1.04 + 1e-8)
    assert close(adv, [[0, -0.6 / s, -1.1 / s, -0.1 / s], [-0.1 / s, 1.9 / s, 0, 0]])


def test_reinforce_pp_on_a_constant_batch_is_only_centred_to_zero() -> None:
    mask = t([[1, 0], [0, 1]])
    adv, returns = ADVANTAGES.get("reinforce_pp")(t([[1, 0], [0, 1]]), mask, AlgorithmConfig())
    assert close(returns, [[1, 0], [0, 1]])
    assert torch.equal(adv, torch.zeros(2, 2))


def test_reinforce_pp_baseline_subtracts_the_group_mean_score_on_the_last_token() -> None:
    # Scores 1 and 0 (group mean 0.5), gamma 1: G = [0.5] * 3 and [-0.5] * 2.
    # Valid G: mean 0.1, deviations 0.4 (x3) and -0.6 (x2), var (0.48 + 0.72) / 5 = 0.24.
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards = last_token_rewards([1, 0], mask)
    adv, returns = ADVANTAGES.get("reinforce_pp_baseline")(
        rewards, mask, AlgorithmConfig(group_size=2)
    )
    assert close(returns, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0]])
    p, n = 0.4 / math.sqrt(0.24 + 1e-8), -0.6 / math.sqrt(0.24 + 1e-8)
    assert close(adv, [[p, p, p], [n, n, 0]])


def test_gae_with_responses_starting_at_different_columns() -> None:
    # gamma 0.5, lam 0.5 (gamma * lam = 0.25); V past the last response token is 0.
    # Row 0 (columns 0..2): r [0, 0, 1], V [0.5, 0.25, 0.5]
    #   t2: delta 1 - 0.5 = 0.5;              A = 0.5
    #   t1: delta 0.5 * 0.5 - 0.25 = 0;       A = 0 + 0.25 * 0.5 = 0.125
    #   t0: delta 0.5 * 0.25 - 0.5 = -0.375;  A = -0.375 + 0.25 * 0.125 = -0.34375
    # Row 1 (columns 2..3): r [0, 2], V [1, 0.5]
    #   t3: delta 2 - 0.5 = 1.5;              A = 1.5
    #   t2: delta 0.5 * 0.5 - 1 = -0.75;      A = -0.75 + 0.25 * 1.5 = -0.375
    mask = t([[1, 1, 1, 0], [0, 0, 1, 1]])
    rewards = t([[0, 0, 1, GARBAGE], [GARBAGE, GARBAGE, 0, 2]])
    values = t([[0.5, 0.25, 0.5, GARBAGE], [GARBAGE, GARBAGE, 1, 0.5]])
    cfg = AlgorithmConfig(gamma=0.5, lam=0.5, whiten_advantages=False)
    adv, returns = ADVANTAGES.get("gae")(rewards, mask, cfg, values)
    assert close(adv, [[-0.34375, 0.125, 0.5, 0], [0, 0, -0.375, 1.5]])
    assert close(returns, [[0.15625, 0.375, 1.0, 0], [0, 0, 0.625, 2.0]])


def test_gae_steps_over_a_masked_hole_without_discounting_it() -> None:
    # gamma 0.5, lam 1, response tokens at columns 0 and 2: t2: A = 1 - 0.5 = 0.5;
    # t0: delta = 0.5 * 0.5 - 0.25 = 0, A = 0 + 0.5 * 0.5 = 0.25.
    mask = t([[1, 0, 1]])
    cfg = AlgorithmConfig(gamma=0.5, lam=1.0, whiten_advantages=False)
    adv, _ = ADVANTAGES.get("gae")(t([[0, GARBAGE, 1]]), mask, cfg, t([[0.25, GARBAGE, 0.5]]))
    assert close(adv, [[0.25, 0, 0.5]])


def test_gae_returns_are_taken_before_the_advantages_are_whitened() -> None:
    # gamma = lam = 1, r [0, 1], V [0.5, 0]: A = [0.5, 1], returns A + V = [1, 1];
    # whitened A: mean 0.75, std 0.25 -> [-1, 1].
    mask = t([[1, 1]])
    cfg = AlgorithmConfig(whiten_advantages=True)
    adv, returns = ADVANTAGES.get("gae")(t([[0, 1]]), mask, cfg, t([[0.5, 0]]))
    assert close(returns, [[1, 1]])
    assert close(adv, [[-1, 1]], atol=1e-4)


def test_gae_refuses_to_run_without_critic_values() -> None:
    with pytest.raises(ValueError, match="critic values"):
        ADVANTAGES.get("gae")(t([[1]]), t([[1]]), AlgorithmConfig())


def test_scores_land_on_each_rows_last_response_token() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    placed = at_last_token(torch.tensor([2.0, -1.0, 5.0]), mask)
    # The third row has no response: its score lands nowhere.
    assert placed.tolist() == [[0, 0, 0, 2], [0, 0, -1, 0], [0, 0, 0, 0]]


def test_reinforce_pp_baseline_centres_the_scores_before_adding_the_kl_penalty() -> None:
    # Two groups of two, equal scores; only the first group's responses drifted from the
    # reference (penalty -0.1 a token). OpenRLHF's order: the baseline centres the scores
    # (to 0 here), then the penalty is added, so G = [-0.2, -0.1] in the first group and 0 in
    # the second (gamma 1). Centring after the penalty would cancel the shared drift.
    cfg = AlgorithmConfig(group_size=2, gamma=1.0)
    mask = torch.ones(4, 2)
    scores = at_last_token(torch.ones(4), mask)
    penalty = t([[-0.1, -0.1], [-0.1, -0.1], [0.0, 0.0], [0.0, 0.0]])
    _, returns = ADVANTAGES.get("reinforce_pp_baseline")(scores, mask, cfg, None, penalty)
    assert close(returns, [[-0.2, -0.1], [-0.2, -0.1], [0.0, 0.0], [0.0, 0.0]])


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_normalised_estimators_take_no_kl_penalty_in_the_reward(name: str) -> None:
    assert not ADVANTAGES.traits(name).kl_in_reward
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="put the KL in the loss"):
        ADVANTAGES.get(name)(mask, mask, AlgorithmConfig(group_size=2), None, -0.1 * mask)
