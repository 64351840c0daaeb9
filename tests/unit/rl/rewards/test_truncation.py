"""rl.rewards.truncation: which samples count as cut by a limit, and how their scores are
capped by their group's finished ones."""

from __future__ import annotations

import pytest
import torch

from rl.agents.environment import ToolUse
from rl.rewards.truncation import cap_truncated, is_truncated
from rl.types import Episode, Sample


def _sample(finish_reason: str, max_turns_reached: bool | None = None) -> Sample:
    """A finished single-turn sample, or an episode's when `max_turns_reached` is given."""
    episode = None
    if max_turns_reached is not None:
        episode = Episode(ToolUse(), [], None, max_turns_reached=max_turns_reached)
    return Sample([1], group_id=0, finish_reason=finish_reason, episode=episode)


@pytest.mark.parametrize(
    ("finish_reason", "max_turns_reached", "truncated"),
    [
        ("stop", None, False),  # a single-turn response that ended itself
        ("length", None, True),  # ... cut at rollout.max_new_tokens
        ("stop", False, False),  # an episode its environment ended
        ("length", False, True),  # ... cut at rollout.max_new_tokens
        ("stop", True, True),  # ... stopped by agent.max_turns
    ],
)
def test_a_sample_is_truncated_when_a_length_or_turn_limit_ended_it(
    finish_reason: str, max_turns_reached: bool | None, truncated: bool
) -> None:
    assert is_truncated(_sample(finish_reason, max_turns_reached)) is truncated


def test_a_truncated_sample_scores_at_most_the_lowest_finished_one() -> None:
    # Finished: right (0.9), wrong after a -0.1 hint (-0.1). Truncated: 0 (rambled, never
    # answered) is capped to the lowest finished, -0.1; -0.5 is below it already and stays.
    scores = torch.tensor([0.9, -0.1, 0.0, -0.5])
    truncated = torch.tensor([False, False, True, True])
    assert cap_truncated(scores, truncated).tolist() == pytest.approx([0.9, -0.1, -0.1, -0.5])


def test_a_group_with_no_finished_sample_keeps_its_scores() -> None:
    scores = torch.tensor([0.0, -0.1, 1.0])
    assert cap_truncated(scores, torch.tensor([True, True, True])).tolist() == pytest.approx(
        [0.0, -0.1, 1.0]
    )


def test_a_group_with_no_truncated_sample_keeps_its_scores() -> None:
    scores = torch.tensor([0.0, -0.1, 1.0])
    assert cap_truncated(scores, torch.tensor([False, False, False])).tolist() == pytest.approx(
        [0.0, -0.1, 1.0]
    )
