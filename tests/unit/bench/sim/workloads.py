"""Workloads the policies' tests share: every response the same length, so that step times
follow from the cost model by hand."""

from __future__ import annotations

import dataclasses

from tests.unit.bench.bench_modules import bench_import

cluster = bench_import("sim.cluster")
lengths = bench_import("sim.lengths")


def exact(num_steps: int, groups: int, **changes) -> cluster.Workload:
    """`groups` groups of 2 samples a step, each exactly 1,000 tokens after a 100-token prompt."""
    workload = cluster.Workload(
        num_steps=num_steps, groups_per_step=groups, group_size=2, prompt_tokens=100,
        length=lengths.LogNormal(median=1000, sigma=0.0, cap=4096), max_tokens=4096,
        tokens_per_id=1,
    )  # fmt: skip
    return dataclasses.replace(workload, **changes)
