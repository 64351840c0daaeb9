"""rl.run.scheduler.prompt_groups.step_metrics: how a step combines the metrics of its scoring calls."""

from __future__ import annotations

import pytest

from rl.run.scheduler.prompt_groups import step_metrics


def test_reward_calls_add_up_counts_and_weight_fractions_by_samples() -> None:
    calls = [
        ({"reward/task_mean": 1.0, "reward/task_accuracy": 1.0, "reward/errors": 1.0}, 2),
        ({"reward/task_mean": 0.25, "reward/task_accuracy": 0.5, "reward/errors": 2.0}, 6),
    ]
    metrics = step_metrics(1, [], [], calls)
    # Over the step's 8 samples: 2 + 3 scored above 0, not the mean of the calls' fractions.
    assert metrics["reward/task_accuracy"] == pytest.approx(5 / 8)
    assert metrics["reward/task_mean"] == pytest.approx((2 * 1.0 + 6 * 0.25) / 8)
    assert metrics["reward/errors"] == 3.0
