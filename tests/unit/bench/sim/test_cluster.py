"""bench/sim/cluster.py: the real scheduler on simulated GPUs takes, step by step, the time the
cost model gives each piece of its work in the order the scheduler runs it, and measures
idle time, staleness and waste of what it ran."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import pytest

from rl.types import Sample
from tests.unit.bench.bench_modules import bench_import

cluster = bench_import("sim.cluster")
costs = bench_import("sim.costs")
lengths = bench_import("sim.lengths")
clock_module = bench_import("sim.clock")

COST = costs.CostModel(costs.H100, costs.QWEN25_7B)


def exact(num_steps: int, **changes) -> cluster.Workload:
    """One group of 2 samples a step, each exactly 1,000 tokens after a 100-token prompt."""
    workload = cluster.Workload(
        num_steps=num_steps, groups_per_step=1, group_size=2, prompt_tokens=100,
        length=lengths.LogNormal(median=1000, sigma=0.0, cap=4096), max_tokens=4096,
        tokens_per_id=1,
    )  # fmt: skip
    return dataclasses.replace(workload, **changes)


def parts() -> tuple[float, float, float]:
    """(generate, train, sync) of one `exact` step on one engine: both samples prefilled, then
    1,000 decode steps of the pair, their contexts growing from 200 by 2 a step (a step's
    time is linear in its context: the time at the middle context, times 1,000)."""
    generate = 2 * COST.prefill_s(100, 0) + 1000 * COST.decode_step_s(2, 200 + 1000)
    train = COST.train_s([1100, 1100], gpus=1)
    return generate, train, COST.sync_s(colocated_on_one_node=False)


def test_a_synchronous_step_generates_then_trains_then_syncs() -> None:
    result = cluster.simulate(COST, cluster.Placement.split(2, 1), exact(3), cluster.Schedule(0))
    step = sum(parts())
    assert [m["time/step_s"] for m in result.steps] == pytest.approx([step] * 3, rel=1e-9)
    assert result.steps_per_hour == pytest.approx(3600 / step, rel=1e-9)


def test_idle_time_per_role_is_what_the_other_role_works() -> None:
    result = cluster.simulate(COST, cluster.Placement.split(2, 1), exact(3), cluster.Schedule(0))
    generate, train, sync = parts()
    step = generate + train + sync
    assert result.rollout_idle == pytest.approx(train / step, rel=1e-9)
    assert result.trainer_idle == pytest.approx(generate / step, rel=1e-9)
    assert result.gpu_idle == pytest.approx((train + generate) / (2 * step), rel=1e-9)


def test_time_sliced_gpus_move_engine_weights_and_trainer_state_over_pcie_each_turn() -> None:
    result = cluster.simulate(COST, cluster.Placement.colocate(1), exact(3), cluster.Schedule(0))
    generate, _, _ = parts()
    train = COST.train_s([1100, 1100], gpus=1)
    sync = COST.sync_s(colocated_on_one_node=True)
    # Engines sleep before training and wake for the push; the trainer's state comes back
    # for training and leaves once the weights are pushed.
    turns = 2 * COST.engine_sleep_s() + 2 * COST.trainer_offload_s(1)
    assert result.steps[1]["time/step_s"] == pytest.approx(
        generate + train + sync + turns, rel=1e-9
    )


def test_a_trainer_sharing_its_gpus_runs_at_half_speed_while_they_generate() -> None:
    clock = clock_module.SimClock()
    trainer = cluster.SimTrainer(
        clock, COST, cluster.Placement.colocate(8), None, tokens_per_id=1,
        needs_annotation=False, keeps_pushed_weights=True,
    )  # fmt: skip
    sample = Sample([1] * 100, group_id=0, response_ids=[0] * 900, token_versions=[0] * 900)
    full = COST.train_s([1000], gpus=8)
    future: Future = trainer.train(1, [sample], [1.0])
    clock.advance(full / 4)
    trainer.set_speed(cluster.SHARED_SPEED)  # engines start generating
    clock.advance(full / 2)  # a quarter of the work done meanwhile
    trainer.set_speed(1.0)
    clock.wait_first([future])
    assert clock.now() == pytest.approx(full / 4 + full / 2 + full / 2, rel=1e-9)


def test_overlap_raises_steps_per_hour_and_keeps_every_token_within_the_bound() -> None:
    workload = cluster.Workload(
        num_steps=8, groups_per_step=8, group_size=4, prompt_tokens=256,
        length=lengths.LogNormal(median=500, sigma=1.0, cap=8192), max_tokens=8192,
        tokens_per_id=16,
    )  # fmt: skip
    # A trainer as slow as generation, so that there is something to hide.
    slow = dataclasses.replace(COST, eff=dataclasses.replace(COST.eff, train_mfu=0.02))
    placement = cluster.Placement.split(4, 2)
    hours = {}
    for k in (0, 2):
        schedule = cluster.Schedule(k, "interrupt" if k else "finish")
        result = cluster.simulate(slow, placement, workload, schedule)
        assert max(result.staleness_tokens) <= k
        trained = sum(m["rollout/tokens"] for m in result.steps)
        assert sum(result.staleness_tokens.values()) == trained
        hours[k] = result.steps_per_hour
    assert hours[2] > 1.3 * hours[0]


def test_dynamic_sampling_generates_more_groups_and_counts_the_tokens_it_drops() -> None:
    workload = exact(4, groups_per_step=8, group_size=4, accuracy=0.85)
    # At 85% accuracy a group of 4 is all right 52% of the time: dropped and redrawn.
    result = cluster.simulate(
        COST,
        cluster.Placement.split(2, 1),
        workload,
        cluster.Schedule(0, dynamic_sampling_rounds=3),
    )
    generated = sum(m["rollout/generated_groups"] for m in result.steps)
    kept = sum(m["rollout/kept_groups"] for m in result.steps)
    assert generated > kept and generated <= 4 * 3 * 8
    assert result.dropped_tokens == (generated - kept) * 4 * 1000


def test_a_kv_cache_that_cannot_hold_one_sample_is_refused() -> None:
    workload = exact(2, max_tokens=2_000_000)
    with pytest.raises(ValueError, match="less than one sample"):
        cluster.simulate(COST, cluster.Placement.split(2, 1), workload, cluster.Schedule(0))


def test_a_simulated_mixture_of_experts_trains_as_its_active_size_and_syncs_its_total() -> None:
    # Qwen3-30B-A3B's size: 30.5B parameters, 3.35B a token; dense twins of each size.
    moe = costs.Model("MoE", 30.5e9, 48, 2048, 4, 128, tp=1, active_params=3.35e9)
    twins = {
        "moe": moe,
        "active": dataclasses.replace(moe, params=3.35e9, active_params=None),
        "total": dataclasses.replace(moe, active_params=None),
    }
    steps = {
        name: cluster.simulate(
            costs.CostModel(costs.H200, model), cluster.Placement.split(2, 1), exact(2),
            cluster.Schedule(0),
        ).steps[-1]
        for name, model in twins.items()
    }  # fmt: skip
    assert steps["moe"]["perf/busy_s_train"] == pytest.approx(
        steps["active"]["perf/busy_s_train"], rel=1e-9
    )
    assert steps["moe"]["time/sync_s"] == pytest.approx(steps["total"]["time/sync_s"], rel=1e-9)
    # A sync of the total's bytes over the network, a step training 2 x 1,100 tokens.
    assert steps["moe"]["time/sync_s"] == pytest.approx(2 * 30.5e9 / 50e9 + 0.1, rel=1e-9)
    flops = 2 * (6 * 3.35e9 * 1100 + 6 * 48 * 2048 * 1100**2)
    assert steps["moe"]["perf/busy_s_train"] == pytest.approx(flops / (989e12 * 0.35), rel=1e-9)
