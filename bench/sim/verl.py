"""The simulation's calibration anchor: verl's published fully-async experiment, as numbers
and as a configuration of the simulator (docs/scale.md, "Calibration").

Source: verl's recipe/fully_async_policy README. 128 H20 GPUs, Qwen2.5-Math-7B, DAPO, 512
prompts x 16 responses a step, responses up to 28K tokens, rollout TP 4.
"""

from __future__ import annotations

import dataclasses

from sim.cluster import Placement, Result, Schedule, Workload, simulate
from sim.costs import H20, QWEN25_7B, CostModel
from sim.lengths import LogNormal

SYNC_STEP_S = 356.30  # colocated, synchronous
SYNC_GEN_S, SYNC_LOGPROB_S, SYNC_UPDATE_S = 177.85, 53.92, 113.81
STREAM_STEP_S = 231.34  # 64:64, staleness 0 (streaming only)
ASYNC_STEP_S, ASYNC_UPDATE_S = 150.63, 113.16  # 64:64, staleness 0.5, partial rollout
COST = CostModel(H20, dataclasses.replace(QWEN25_7B, name="Qwen2.5-Math-7B", tp=4))
SYNC_PLACEMENT = Placement.colocate(128)


def workload(median: int, num_steps: int, needs_annotation: bool, groups: int = 512) -> Workload:
    """The run's shape; the prompts' length (256 tokens) and the responses' spread (sigma 1)
    are not published and are assumed."""
    cap = 28 * 1024
    return Workload(
        num_steps=num_steps,
        groups_per_step=groups,
        group_size=16,
        prompt_tokens=256,
        length=LogNormal(median=median, sigma=1.0, cap=cap),
        max_tokens=cap,
        needs_annotation=needs_annotation,
        tokens_per_id=64,
    )


def fit_median(target_gen_s: float = SYNC_GEN_S, groups: int = 512) -> tuple[int, Result]:
    """The one fitted number: the median response length at which the synchronous baseline
    generates for as long as verl's did (their mean length is not published), and that
    baseline's run at it. Generation time grows with the median, so a bisection over it, to
    2%."""
    runs: dict[int, Result] = {}

    def sync_at(median: int) -> Result:
        if median not in runs:
            baseline = workload(median, num_steps=2, needs_annotation=True, groups=groups)
            runs[median] = simulate(COST, SYNC_PLACEMENT, baseline, Schedule(0))
        return runs[median]

    low, high = 256, 8192
    while high - low > max(low // 50, 1):
        middle = (low + high) // 2
        below = sync_at(middle).mean_after_first("perf/busy_s_generate") < target_gen_s
        low, high = (middle, high) if below else (low, middle)
    return high, sync_at(high)


def trainer_costs(sync: Result) -> dict[str, CostModel]:
    """The cost model with verl's own trainer speeds, per placement kind: the MFUs at which
    the simulated trainer of the synchronous baseline `sync` takes as long as verl's did
    (colocated on 128 GPUs: update and old log-probs; split, on 64: update), so that what
    remains to compare is generation and scheduling."""
    eff = COST.eff
    update_128 = sync.mean_after_first("perf/busy_s_train")
    logprob_128 = sync.mean_after_first("perf/busy_s_logprobs")
    colocated = dataclasses.replace(
        eff,
        train_mfu=eff.train_mfu * update_128 / SYNC_UPDATE_S,
        annotate_mfu=eff.annotate_mfu * logprob_128 / SYNC_LOGPROB_S,
    )
    # Half the GPUs: the same work takes twice as long at the same MFU.
    split = dataclasses.replace(eff, train_mfu=eff.train_mfu * 2 * update_128 / ASYNC_UPDATE_S)
    return {
        "colocate": dataclasses.replace(COST, eff=colocated),
        "split": dataclasses.replace(COST, eff=split),
    }
