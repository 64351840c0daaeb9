"""bench/sim/areal_async.py: AReaL's policy on simulated GPUs admits rollouts within its
staleness bound, trains the earliest created after recomputing their log-probs, and
interrupts generation at each weight update, the aborted samples resuming with their
prefixes."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.bench.bench_modules import bench_import
from tests.unit.bench.sim.workloads import exact

cluster = bench_import("sim.cluster")
costs = bench_import("sim.costs")
lengths = bench_import("sim.lengths")
areal_async = bench_import("sim.areal_async")

COST = costs.CostModel(costs.H100, costs.QWEN25_7B)
SPLIT = cluster.Placement.split(2, 1)  # one engine, one trainer GPU
SLOW = dataclasses.replace(COST, eff=dataclasses.replace(COST.eff, train_mfu=0.002))


def test_admission_is_areals_capacity_formula() -> None:
    # staleness_manager.py: min(max_concurrent - running,
    #                           (max_staleness + version + 1) x batch - (accepted + running))
    admission = areal_async.Admission(
        consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=6
    )
    assert admission.capacity(version=0) == 6
    admission.running = 6
    assert admission.capacity(version=0) == 0
    admission.running, admission.accepted = 2, 4
    assert admission.capacity(version=0) == 2  # 8 - 6: the staleness bound, not concurrency
    assert admission.capacity(version=1) == 4  # 12 - 6 = 6, but 6 - 2 slots


def test_at_offpolicyness_zero_each_step_trains_only_its_own_version() -> None:
    # AReaL's blog: "When eta = 0, the system degenerates to the synchronous RL setting".
    result = areal_async.simulate(COST, SPLIT, exact(4, 2), areal_async.ArealSchedule(0))
    assert result.staleness_tokens == {0: 4 * 2 * 2 * 1000}
    assert result.reprefilled_tokens == 0  # nothing runs past a weight update


def test_a_trainer_bound_run_trains_tokens_as_old_as_the_bound_and_no_older() -> None:
    # Equal lengths: rollouts finish in the order they started, so the bound on admission
    # is the bound on every trained token's age.
    for eta in (1, 2):
        result = areal_async.simulate(SLOW, SPLIT, exact(8, 2), areal_async.ArealSchedule(eta))
        assert max(result.staleness_tokens) == eta


def test_each_step_recomputes_log_probs_then_trains_then_updates_the_weights() -> None:
    result = areal_async.simulate(COST, SPLIT, exact(3, 1), areal_async.ArealSchedule(0))
    lengths_ = [1100, 1100]
    assert [m["perf/busy_s_logprobs"] for m in result.steps] == pytest.approx(
        [COST.annotate_s(lengths_, gpus=1)] * 3, rel=1e-9
    )
    # At offpolicyness 0 nothing overlaps: generate, recompute, train, sync.
    generate = 2 * COST.prefill_s(100, 0) + 1000 * COST.decode_step_s(2, 2 * (100 + 500))
    step = (
        generate
        + COST.annotate_s(lengths_, gpus=1)
        + COST.train_s(lengths_, gpus=1)
        + COST.sync_s(colocated_on_one_node=False)
    )
    assert [m["time/step_s"] for m in result.steps] == pytest.approx([step] * 3, rel=1e-9)
    unchecked = areal_async.ArealSchedule(0, recompute_logprob=False)
    result = areal_async.simulate(COST, SPLIT, exact(3, 1), unchecked)
    assert [m["perf/busy_s_logprobs"] for m in result.steps] == [0.0] * 3


def test_a_weight_update_interrupts_generation_and_it_resumes_with_its_prefix() -> None:
    long_group = dataclasses.replace(
        exact(8, 1), length=lambda sample: 3000 if sample.group_id == 0 else 1000,
        max_tokens=3000,
    )  # fmt: skip
    result = areal_async.simulate(COST, SPLIT, long_group, areal_async.ArealSchedule(2))
    assert result.reprefilled_tokens > 0
    trained = [m["rollout/tokens"] for m in result.steps]
    assert trained.count(2 * 3000) == 1
    assert sum(trained) == 2 * 3000 + 2 * 1000 * (len(trained) - 1)
    assert sum(result.staleness_tokens.values()) == sum(trained)


def test_the_split_trainer_recomputes_log_probs_at_the_colocated_fits_share_of_its_update() -> None:
    # verl's colocated table: old log-probs 53.92 s beside an update of 113.81 s.
    colocated = dataclasses.replace(
        COST, eff=dataclasses.replace(COST.eff, train_mfu=0.8, annotate_mfu=0.6)
    )
    split = dataclasses.replace(COST, eff=dataclasses.replace(COST.eff, train_mfu=1.6))
    cost = areal_async.split_trainer_cost({"colocate": colocated, "split": split})
    work = [1100, 5000]
    assert cost.annotate_s(work, 64) / cost.train_s(work, 64) == pytest.approx(
        colocated.annotate_s(work, 128) / colocated.train_s(work, 128), rel=1e-12
    )
    assert cost.train_s(work, 64) == split.train_s(work, 64)
