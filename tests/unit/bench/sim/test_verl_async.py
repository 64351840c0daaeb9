"""bench/sim/verl_async.py: verl's fully-async policy on simulated GPUs starts, trains and
syncs as verl's rollouter and trainer do (the bound on groups a version, streaming local
steps, partial rollouts resumed under the new weights), and its calibration against verl's
published speed-ups."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.bench.bench_modules import bench_import
from tests.unit.bench.sim.workloads import exact

cluster = bench_import("sim.cluster")
costs = bench_import("sim.costs")
lengths = bench_import("sim.lengths")
verl = bench_import("sim.verl")
verl_async = bench_import("sim.verl_async")

COST = costs.CostModel(costs.H100, costs.QWEN25_7B)
SPLIT = cluster.Placement.split(2, 1)  # one engine, one trainer GPU


def schedule(staleness: float, partial: bool, trigger: int) -> object:
    """One group a mini-batch, one mini-batch a local step, `trigger` local steps a version."""
    return verl_async.VerlSchedule(
        staleness_threshold=staleness, partial_rollout=partial, ppo_mini_batch_size=1,
        require_batches=1, trigger_parameter_sync_step=trigger,
    )  # fmt: skip


def generate_s(samples: int) -> float:
    """`samples` samples of `exact` prefilled, then decoded together on one engine: 1,000
    steps over contexts growing from 100 each by one token a step (a step's time is linear
    in its context, so the time at the middle context, times 1,000)."""
    middle = samples * (100 + 500)
    return samples * COST.prefill_s(100, 0) + 1000 * COST.decode_step_s(samples, middle)


def test_the_128_gpu_run_counts_768_groups_a_version_and_runs_256_at_once() -> None:
    # verl's formulas (fully_async_rollouter.py), by hand: required = 32 x 4 = 128;
    # max_required = 128 x (0.5 + 1) x 4 = 768; concurrency = 16 servers (64 GPUs / TP 4) x 16.
    assert verl_async.ASYNC.required_samples == 128
    assert verl_async.ASYNC.max_required_samples == 768
    assert verl_async.STREAMING.max_required_samples == 512
    assert verl_async.SERVER_CONCURRENCY * (64 // 4) == 256


def test_the_rollouter_stops_at_its_bound_and_a_sync_resets_it_to_what_it_carries() -> None:
    rollouter = verl_async.Rollouter(max_required_samples=6, max_concurrent_samples=4)
    made = iter(range(100))

    def start(in_flight: int) -> object:
        return rollouter.next(in_flight, lambda: f"new {next(made)}")

    assert [start(in_flight) for in_flight in range(5)] == [f"new {i}" for i in range(4)] + [None]
    assert not rollouter.paused  # waiting for a slot, not paused
    assert [start(2), start(3), start(0)] == ["new 4", "new 5", None]
    assert rollouter.paused and start(0) is None  # until the sync
    rollouter.cancelled.append("interrupted")
    rollouter.synced(carried=3)
    # The interrupted group resumes first and counts nothing; then 6 - 3 new ones.
    assert [start(0) for _ in range(5)] == ["interrupted", "new 6", "new 7", "new 8", None]


def test_one_group_a_version_at_staleness_zero_is_the_synchronous_step() -> None:
    # verl's README, mode 1 (trigger_parameter_sync_step=1, staleness_threshold=0).
    result = verl_async.simulate(COST, SPLIT, exact(3, 1), schedule(0.0, False, trigger=1))
    step = (
        generate_s(2)
        + COST.train_s([1100, 1100], gpus=1)
        + COST.sync_s(colocated_on_one_node=False)
    )
    assert [m["time/step_s"] for m in result.steps] == pytest.approx([step] * 3, rel=1e-9)
    assert result.steps_per_hour == pytest.approx(3600 / step, rel=1e-9)


def test_streaming_trains_each_mini_batch_as_it_comes_and_syncs_after_the_last() -> None:
    # Two groups a version, generated together; two local steps of one group, then a sync.
    result = verl_async.simulate(COST, SPLIT, exact(3, 2), schedule(0.0, False, trigger=2))
    train = COST.train_s([1100, 1100], gpus=1)
    step = generate_s(4) + 2 * train + COST.sync_s(colocated_on_one_node=False)
    assert [m["time/step_s"] for m in result.steps] == pytest.approx([step] * 3, rel=1e-9)
    assert result.staleness_tokens == {0: 3 * 4 * 1000}  # each version trains its own


def test_a_trainer_bound_run_trains_the_staleness_threshold_share_of_stale_groups() -> None:
    # verl's README: staleness_threshold is "the maximum proportion of stale samples". A
    # trainer much slower than generation lets the rollouter always fill its bound.
    slow = dataclasses.replace(COST, eff=dataclasses.replace(COST.eff, train_mfu=0.001))
    result = verl_async.simulate(slow, SPLIT, exact(6, 4), schedule(0.5, True, trigger=4))
    steady = result.steps[1:]
    assert [m["rollout/stale_groups"] / m["rollout/kept_groups"] for m in steady] == [0.5] * 5
    assert max(result.staleness_tokens) == 1


def one_long_group(num_steps: int) -> object:
    """One group a step of 1,000-token responses, but group 0's are 3,000 tokens."""
    return dataclasses.replace(
        exact(num_steps, 1), length=lambda sample: 3000 if sample.group_id == 0 else 1000,
        max_tokens=3000,
    )  # fmt: skip


def test_a_partial_rollout_resumes_under_the_new_weights_and_loses_no_token() -> None:
    # Group 0 runs 3 times longer than the rest: two syncs interrupt it, and it resumes.
    result = verl_async.simulate(COST, SPLIT, one_long_group(8), schedule(1.0, True, trigger=1))
    assert result.reprefilled_tokens > 0
    assert sum(m["rollout/resumed_groups"] for m in result.steps) > 0
    # Every trained group is whole: the long one once, the others 2 x 1,000 tokens each.
    trained = [m["rollout/tokens"] for m in result.steps]
    assert trained.count(2 * 3000) == 1
    assert sum(trained) == 2 * 3000 + 2 * 1000 * (len(trained) - 1)
    assert sum(result.staleness_tokens.values()) == sum(trained)
    assert max(result.staleness_tokens) == 2  # the long group's first tokens, two syncs back


def test_a_sync_without_partial_rollout_waits_for_the_groups_in_flight() -> None:
    result = verl_async.simulate(COST, SPLIT, one_long_group(4), schedule(1.0, False, trigger=1))
    assert result.reprefilled_tokens == 0
    assert not any(m["rollout/resumed_groups"] for m in result.steps)


def test_a_version_must_train_the_workloads_step() -> None:
    with pytest.raises(ValueError, match="3 groups a version, but the workload trains 2"):
        verl_async.simulate(COST, SPLIT, exact(2, 2), schedule(0.0, False, trigger=3))
    with pytest.raises(ValueError, match="on their own GPUs"):
        verl_async.simulate(
            COST, cluster.Placement.colocate(2), exact(2, 1), schedule(0.0, False, trigger=1)
        )


def test_the_schedule_scales_its_mini_batch_to_another_batch() -> None:
    assert verl_async.ASYNC.for_groups(256).ppo_mini_batch_size == 16
    with pytest.raises(ValueError, match="100 groups a step"):
        verl_async.ASYNC.for_groups(100)
