"""Rewards: rule-based verifiers, users' functions and reward models, summed with weights.

`RewardScorer` (rl.rewards.scorer) scores batches; `check_reward_terms` validates a config
without starting anything; `VERIFIERS` names the built-in verifiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.rewards.terms import check_reward_terms
from rl.rewards.verifiers import VERIFIERS

if TYPE_CHECKING:
    from rl.rewards.scorer import RewardScorer

__all__ = ["VERIFIERS", "RewardScorer", "check_reward_terms"]


def __getattr__(name: str) -> object:
    # The scorer pulls in torch and Ray; the reward worker processes import this package and
    # should start in a second, so it loads on first use.
    if name == "RewardScorer":
        from rl.rewards.scorer import RewardScorer

        return RewardScorer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
