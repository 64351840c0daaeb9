"""bench/simulate.py and bench/sim/verl.py: a small sweep of the real scheduler on simulated GPUs runs and is
reported run by run; the calibration's one fitted number is recovered from the generation
time it gives."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.unit.bench.bench_modules import bench_import, load_bench_module

simulate = load_bench_module("simulate")
verl = bench_import("sim.verl")


def small(num_steps: int) -> object:
    return dataclasses.replace(simulate.reasoning(num_steps=num_steps, groups=8), group_size=4)


def test_a_staleness_sweep_reports_each_run_and_its_staleness_within_the_bound() -> None:
    runs = simulate.staleness_sweep(small(num_steps=6))
    runs = [
        dataclasses.replace(r, workload=dataclasses.replace(r.workload, num_steps=6)) for r in runs
    ]
    results = simulate.run_all(runs, workers=1)
    table, series = simulate.staleness_report(list(zip(runs, results, strict=True)))
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == len(runs) == 20
    for run, result, row in zip(runs, results, rows, strict=True):
        assert max(result.staleness_tokens) <= run.schedule.max_staleness
        shares = re.findall(r"(\d+)%", row.split("|")[6])
        assert len(shares) == max(result.staleness_tokens) + 1
        assert sum(map(int, shares)) == pytest.approx(100, abs=len(shares))  # rounded
    # Each placement's line per partial-rollout mode starts at k = 0 and ends at k = 4.
    for lines in series.values():
        assert {mode: [k for k, _ in points] for mode, points in lines.items()} == {
            mode: [0, 1, 2, 4] for mode in ("finish", "abort", "interrupt")
        }


def test_the_fitted_median_gives_back_the_generation_time_it_was_fitted_to() -> None:
    median = 1500
    workload = verl.workload(median, num_steps=2, needs_annotation=True, groups=8)
    result = simulate.simulate(verl.COST, verl.SYNC_PLACEMENT, workload, simulate.Schedule(0))
    generate_s = result.steps[1]["perf/busy_s_generate"]
    fitted, sync = verl.fit_median(generate_s, groups=8)
    assert fitted == pytest.approx(median, rel=0.03)
    assert sync.mean_after_first("perf/busy_s_generate") == pytest.approx(generate_s, rel=0.05)


def test_split_placements_keep_the_engines_whole() -> None:
    assert [p.label() for p in simulate.placements(8, tp=2)] == [
        "colocate",
        "split 4:4",
        "split 6:2",
    ]
    assert [p.label() for p in simulate.placements(8, tp=1)] == [
        "colocate",
        "split 4:4",
        "split 6:2",
    ]
    assert [p.label() for p in simulate.placements(4, tp=4)] == ["colocate"]


def test_the_policy_sweep_runs_each_system_on_its_own_policy_and_reports_against_sync() -> None:
    """Tandem's rows run its scheduler, verl's and AReaL's their own policies (each Result's
    step metrics say which: carry's bias metrics, verl's wait for samples); every cluster's
    rows are reported over its own synchronous row."""
    workload = dataclasses.replace(small(num_steps=5), groups_per_step=16)  # verl: 16 batches
    runs = [
        dataclasses.replace(r, workload=dataclasses.replace(r.workload, num_steps=5))
        for r in simulate.policy_sweep(workload)
        if r.placement.gpus == 8
    ]
    results = simulate.run_all(runs, workers=1)
    for run, result in zip(runs, results, strict=True):
        assert ("carry/stale_token_share" in result.steps[-1]) == ("carry" in run.label)
        assert ("perf/wait_s" in result.steps[-1]) == run.label.startswith(("verl", "AReaL"))
    table = simulate.policy_report(list(zip(runs, results, strict=True)))
    rows = [line.split("|") for line in table.splitlines()[2:]]
    assert len(rows) == len(runs)
    sync = results[0].steps_per_hour
    for row, result in zip(rows, results, strict=True):
        assert row[4].strip() == f"{result.steps_per_hour / sync:.2f}x"


def test_the_sequence_parallel_sweep_trains_128k_samples_only_where_a_rank_holds_one() -> None:
    runs = [
        dataclasses.replace(
            run, workload=dataclasses.replace(run.workload, num_steps=2, groups_per_step=2)
        )
        for run in simulate.sequence_parallel_sweep(small(num_steps=2))
    ]
    results = simulate.run_all(runs, workers=1)
    table = simulate.sequence_parallel_report(list(zip(runs, results, strict=True)))
    rows = {
        row[0]: row[2:]
        for row in (line.strip("| ").split(" | ") for line in table.splitlines()[2:])
    }
    # A 131,072-token sample: 53.0 GB on one rank (test_costs), a share of it on more.
    assert {n: (fits, link) for n, (fits, link, _, _) in rows.items()} == {
        "1": ("yes", "-"), "2": ("yes", "NVLink"), "4": ("yes", "NVLink"),
        "7": ("yes", "NVLink"), "14": ("yes", "network"),
    }  # fmt: skip
    assert all((speed == "-") == (fits == "no") for fits, _, _, speed in rows.values())
