"""bench/simulate.py: the real scheduler on a simulated clock takes, step by step, the time
the cost model gives its work, and overlaps generation with training at k >= 1."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.bench.bench_modules import load_bench_module

simulate = load_bench_module("simulate")


def test_a_synchronous_step_takes_generation_then_training_then_the_sync() -> None:
    # One engine, one group of 2 samples of exactly 1000 tokens (no spread).
    workload = simulate.Workload(
        num_steps=2, groups_per_step=1, group_size=2, prompt_tokens=100,
        median_tokens=1000, sigma=0.0, num_engines=1,
    )  # fmt: skip
    cost = simulate.CostModel()
    steps = simulate.simulate(workload, cost, k=0)
    generate = 2 * 100 * cost.prefill_s_per_token + 1000 * cost.decode_s(2)
    train = cost.train_s(2 * (100 + 1000))
    expected = generate + train + cost.sync_s()
    assert [m["time/step_s"] for m in steps] == pytest.approx([expected, expected], rel=1e-12)
    assert [m["time/sync_s"] for m in steps] == pytest.approx([cost.sync_s()] * 2, rel=1e-12)


def test_overlap_raises_steps_per_hour_within_the_staleness_bound() -> None:
    workload = simulate.Workload(num_steps=6, groups_per_step=8, group_size=4, num_engines=2)
    # A trainer as slow as generation, so that there is something to hide.
    cost = dataclasses.replace(simulate.CostModel(), mfu=0.01)
    hours = {}
    for k in (0, 1):
        steps = simulate.simulate(workload, cost, k)
        assert len(steps) == workload.num_steps
        assert max(m["rollout/staleness_max"] for m in steps) <= k
        hours[k] = sum(m["time/step_s"] for m in steps)
    assert hours[1] < 0.9 * hours[0]


def test_aborted_samples_resume_after_their_prefix_under_the_next_version() -> None:
    workload = simulate.Workload(num_steps=5, groups_per_step=8, group_size=4, num_engines=2)
    steps = simulate.simulate(workload, simulate.CostModel(), k=2, abort_every=256)
    assert len(steps) == workload.num_steps
    # Later steps' samples stopped at abort points and went on after a sync.
    assert sum(m["rollout/resumed_samples"] for m in steps) > 0
    assert max(m["rollout/staleness_max"] for m in steps) <= 2


def test_dynamic_sampling_draws_more_groups_where_a_step_keeps_too_few() -> None:
    # At 85% accuracy a group of 4 is all right about half the time: dropped.
    workload = simulate.Workload(
        num_steps=4, groups_per_step=8, group_size=4, num_engines=2, accuracy=0.85
    )
    steps = simulate.simulate(workload, simulate.CostModel(), k=1, dynamic_sampling_rounds=3)
    assert len(steps) == workload.num_steps
    assert all(m["rollout/generated_groups"] > m["rollout/kept_groups"] for m in steps)
    assert all(m["rollout/generated_groups"] <= 3 * 8 for m in steps)
