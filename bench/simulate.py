"""Tandem's scheduler at cluster scale, by simulation (issue 35; docs/scale.md).

The real scheduler (rl.run.scheduler.loop) runs against simulated vLLM engines and trainer
groups on a simulated clock (bench/sim): the sweeps below over GPUs, placement, staleness,
partial rollouts and dynamic sampling, the trainer's sequence-parallel degree on long
samples, and a calibration against verl's published fully-async runs.

    .venv/bin/python bench/simulate.py [--lengths FILE] [--only NAME] [--write-docs]

--lengths replays a trace of response lengths (one token count a line) instead of the
long-tailed distribution. --write-docs replaces the generated sections of docs/scale.md and
its plots. The simulated clock never sleeps: the whole set runs in about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from docs_section import write_section
from sim import areal_async, verl, verl_async
from sim.cluster import Placement, Result, Schedule, Workload, simulate
from sim.costs import H100, H200, QWEN25_7B, QWEN25_32B, CostModel
from sim.lengths import LogNormal, Replay, read_lengths

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "scale.md"
SPLITS = (0.5, 0.75)  # rollout shares tried for "split with the best ratio"


@dataclass(frozen=True)
class Run:
    sweep: str
    label: str  # its row
    cost: CostModel
    placement: Placement
    workload: Workload
    # Tandem's scheduler (sim.cluster), or another system's policy (sim.verl_async,
    # sim.areal_async) with its own schedule
    schedule: Schedule | verl_async.VerlSchedule | areal_async.ArealSchedule


def reasoning(length: Callable | None = None, num_steps: int = 8, groups: int = 256) -> Workload:
    """Long-tailed reasoning RL: 256 prompts x 16 responses a step, responses log-normal
    around 2,000 tokens (sigma 1: about one in 260 reaches the 28,672 cap)."""
    cap = 28_672
    return Workload(
        num_steps=num_steps,
        groups_per_step=groups,
        group_size=16,
        prompt_tokens=1024,
        length=length or LogNormal(median=2000, sigma=1.0, cap=cap),
        max_tokens=cap,
        tokens_per_id=64,
    )


OVERLAP = Schedule(max_staleness=1, partial_rollout="interrupt")

SYNC_LABEL = "verl sync: colocate k=0"
STREAM_LABEL = "verl streaming: split 64:64, verl's policy, staleness 0"
ASYNC_LABEL = "verl async: split 64:64, verl's policy, staleness 0.5, partial rollout"


def carry(k: int, groups: int, pool: int) -> Schedule:
    """partial_rollout "carry" at its automatic abort point, `pool` steps' groups in flight."""
    return Schedule(k, "carry", groups_in_flight=pool * groups)


def placements(gpus: int, tp: int) -> list[Placement]:
    """Colocated, and split at each of SPLITS (rollout GPUs a multiple of the engines' TP)."""
    splits = {max(tp, round(gpus * share / tp) * tp) for share in SPLITS}
    return [Placement.colocate(gpus)] + [
        Placement.split(gpus, r) for r in sorted(splits) if r < gpus
    ]


def gpu_sweep(workload: Workload) -> list[Run]:
    """6 steps: at k <= 1 the steady state repeats every step or two."""
    workload = dataclasses.replace(workload, num_steps=6)
    runs = []
    for cost in (CostModel(H100, QWEN25_7B), CostModel(H200, QWEN25_32B)):
        for gpus in (8, 32, 128, 512):
            runs.append(
                Run(
                    "gpus",
                    "colocate k=0",
                    cost,
                    Placement.colocate(gpus),
                    workload,
                    Schedule(0),
                )
            )
            for placement in placements(gpus, cost.model.tp):
                label = f"{placement.kind} k=1 interrupt"
                runs.append(Run("gpus", label, cost, placement, workload, OVERLAP))
    return runs


def staleness_sweep(workload: Workload) -> list[Run]:
    """12 steps, so that the steady state at k = 4 spans more than one tail."""
    cost, gpus = CostModel(H100, QWEN25_7B), 128
    workload = dataclasses.replace(workload, num_steps=12)
    runs = []
    for placement in (Placement.colocate(gpus), Placement.split(gpus, gpus // 2)):
        runs.append(Run("staleness", placement.label(), cost, placement, workload, Schedule(0)))
        for k in (1, 2, 4):
            for partial in ("finish", "abort", "interrupt"):
                schedule = Schedule(k, partial)
                runs.append(
                    Run("staleness", placement.label(), cost, placement, workload, schedule)
                )
    return runs


def abort_sweep(workload: Workload) -> list[Run]:
    """partial_rollout "abort" at a fixed 2,048 tokens, against the staleness sweep's "auto"
    (the scheduler's default: the last synced step's 95th percentile)."""
    cost, placement = CostModel(H100, QWEN25_7B), Placement.colocate(128)
    workload = dataclasses.replace(workload, num_steps=12)
    return [
        Run("abort", "colocate", cost, placement, workload, Schedule(k, "abort", 2048))
        for k in (1, 2, 4)
    ]


def dynamic_sampling_sweep(workload: Workload) -> list[Run]:
    """At 85% accuracy, a group of 16 is all right 7% of the time: dropped and redrawn."""
    cost, gpus = CostModel(H100, QWEN25_7B), 128
    workload = dataclasses.replace(workload, accuracy=0.85)
    placement = Placement.colocate(gpus)
    return [
        Run(
            "dynamic",
            placement.label(),
            cost,
            placement,
            workload,
            Schedule(k, "interrupt" if k else "finish", dynamic_sampling_rounds=rounds),
        )  # fmt: skip
        for k in (0, 1)
        for rounds in (0, 3)
    ]


def policy_sweep(workload: Workload) -> list[Run]:
    """Tandem's modes against verl's fully-async policy and AReaL's on the same H100
    clusters, 8 to 512 GPUs: each system at its published setting (verl staleness 0.5 with
    partial rollouts, split half and half; AReaL eta 4, split), Tandem's carry-over at k = 2
    with three steps' groups in flight; at 128 GPUs also carry-over at its defaults (twice
    the groups) at k = 1 and 2, and split."""
    cost = CostModel(H100, QWEN25_7B)
    workload = dataclasses.replace(workload, num_steps=10)
    groups = workload.groups_per_step
    runs = []
    for gpus in (8, 32, 128, 512):
        colocate, split = Placement.colocate(gpus), Placement.split(gpus, gpus // 2)
        halves = f"{split.rollout_gpus}:{split.trainer_gpus}"
        rows = [
            ("Tandem: colocate k=0", colocate, Schedule(0)),
            ("Tandem: colocate k=1 abort", colocate, Schedule(1, "abort")),
            ("Tandem: colocate k=1 interrupt (not reproducible)", colocate, OVERLAP),
            ("Tandem: colocate k=2 carry, 3x groups", colocate, carry(2, groups, 3)),
        ]
        if gpus == 128:
            rows += [
                ("Tandem: colocate k=1 carry, 2x groups", colocate, carry(1, groups, 2)),
                ("Tandem: colocate k=2 carry, 2x groups", colocate, carry(2, groups, 2)),
                (f"Tandem: split {halves} k=2 carry, 3x groups", split, carry(2, groups, 3)),
                (f"Tandem: split {halves} k=0", split, Schedule(0)),
                (f"Tandem: split {halves} k=0 streaming", split, Schedule(0, streaming=True)),
            ]
        rows.append(
            (
                f"Tandem: split {halves} k=2 abort streaming",
                split,
                Schedule(2, "abort", streaming=True),
            )
        )
        rows += [
            (
                f"verl: split {halves} async 0.5 (not reproducible)",
                split,
                verl_async.ASYNC.for_groups(groups),
            ),
            (
                f"AReaL: split {halves} eta 4 (not reproducible)",
                split,
                areal_async.ArealSchedule(4),
            ),
        ]
        runs += [Run("policies", label, cost, p, workload, sched) for label, p, sched in rows]
    return runs


def long_samples(num_steps: int = 4) -> Workload:
    """Long-response RL (agents, long reasoning): 64 prompts x 16 responses a step, responses
    log-normal around 16,000 tokens up to 130,048 (131,072 with the prompt)."""
    cap = LONG_SAMPLE - 1024
    return Workload(
        num_steps=num_steps,
        groups_per_step=64,
        group_size=16,
        prompt_tokens=1024,
        length=LogNormal(median=16_000, sigma=1.0, cap=cap),
        max_tokens=cap,
        tokens_per_id=256,
    )


LONG_SAMPLE = 131_072  # the longest sample of `long_samples`, prompt included
# Degrees that divide Qwen2.5-7B's 28 heads; 14 spans two 8-GPU nodes.
SEQUENCE_PARALLEL = (1, 2, 4, 7, 14)


def sequence_parallel_sweep(workload: Workload) -> list[Run]:
    """Qwen2.5-7B on 64 H100s, colocated at k = 0, on `long_samples` (its own workload, not
    `workload`), at each degree of SEQUENCE_PARALLEL."""
    long = long_samples()
    return [
        Run(
            "sequence-parallel",
            f"trainer.sequence_parallel={n}",
            CostModel(H100, QWEN25_7B, sequence_parallel=n),
            Placement.colocate(64),
            long,
            Schedule(0),
        )
        for n in SEQUENCE_PARALLEL
    ]


def _simulate(
    cost: CostModel, placement: Placement, workload: Workload, schedule: object
) -> Result:
    """A run of Tandem's scheduler, or of the policy whose schedule `schedule` is."""
    if isinstance(schedule, verl_async.VerlSchedule):
        return verl_async.simulate(cost, placement, workload, schedule)
    if isinstance(schedule, areal_async.ArealSchedule):
        return areal_async.simulate(cost, placement, workload, schedule)
    return simulate(cost, placement, workload, schedule)


def run_all(runs: list[Run], workers: int = 2) -> list[Result]:
    """Each run's result, in order; the largest runs go first so that no process is left
    with one at the end."""
    args = [(r.cost, r.placement, r.workload, r.schedule) for r in runs]
    if workers <= 1:
        return [_simulate(*a) for a in args]
    order = sorted(
        range(len(runs)),
        key=lambda i: -runs[i].workload.num_steps * runs[i].workload.groups_per_step,
    )
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(_simulate, *zip(*(args[i] for i in order), strict=True)))
    by_index = dict(zip(order, results, strict=True))
    return [by_index[i] for i in range(len(runs))]


def calibration_runs(median: int, sync: Result) -> list[Run]:
    """verl's three configurations (its synchronous step on Tandem's scheduler at k = 0, its
    streaming and fully-async steps on its own policy, sim.verl_async) with the cost model
    as it is, then again with verl's own trainer speeds (taken from `sync`, the synchronous
    baseline at the fitted median) beside Tandem's configurations and AReaL's policy."""
    baseline = verl.workload(median, num_steps=4, needs_annotation=True)
    overlapped = verl.workload(median, num_steps=8, needs_annotation=False)
    colocate, split = verl.SYNC_PLACEMENT, Placement.split(128, 64)
    anchor = [
        (SYNC_LABEL, colocate, baseline, Schedule(0)),
        (STREAM_LABEL, split, overlapped, verl_async.STREAMING),
        (ASYNC_LABEL, split, overlapped, verl_async.ASYNC),
    ]
    groups = overlapped.groups_per_step
    tandem = [
        ("Tandem: colocate k=1 interrupt (not reproducible)", colocate, overlapped, OVERLAP),
        ("Tandem: split 96:32 k=1 interrupt (not reproducible)", Placement.split(128, 96),
         overlapped, OVERLAP),
        ("Tandem: colocate k=1 carry, 2x groups", colocate, overlapped, carry(1, groups, 2)),
        ("Tandem: colocate k=2 carry, 3x groups", colocate, overlapped, carry(2, groups, 3)),
        ("Tandem: split 64:64 k=2 carry, 3x groups", split, overlapped, carry(2, groups, 3)),
        ("Tandem: split 64:64 k=0", split, overlapped, Schedule(0)),
        ("Tandem: split 64:64 k=0 streaming", split, overlapped, Schedule(0, streaming=True)),
        ("Tandem: split 80:48 k=1 abort streaming", Placement.split(128, 80), overlapped,
         Schedule(1, "abort", streaming=True)),
        ("Tandem: split 80:48 k=2 abort streaming", Placement.split(128, 80), overlapped,
         Schedule(2, "abort", streaming=True)),
        ("Tandem: split 80:48 k=2 abort streaming, chunks of 1 group", Placement.split(128, 80),
         overlapped, Schedule(2, "abort", streaming=True, stream_groups=1)),
        ("Tandem: split 80:48 k=2 abort streaming, chunks of 128 groups",
         Placement.split(128, 80), overlapped,
         Schedule(2, "abort", streaming=True, stream_groups=128)),
    ]  # fmt: skip
    fitted = verl.trainer_costs(sync)
    return [
        *(Run("calibration", label, verl.COST, p, w, s) for label, p, w, s in anchor),
        *(
            Run("calibration-trainer", label, fitted[p.kind], p, w, s)
            for label, p, w, s in anchor + tandem
        ),
        Run(
            "calibration-trainer",
            "AReaL: split 64:64 eta 4 (not reproducible)",
            areal_async.split_trainer_cost(fitted),
            split,
            overlapped,
            areal_async.ArealSchedule(4),
        ),
    ]


# -- reports ------------------------------------------------------------------------------------


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _staleness(result: Result) -> str:
    total = sum(result.staleness_tokens.values())
    return " / ".join(
        _pct(result.staleness_tokens.get(lag, 0), total)
        for lag in range(max(result.staleness_tokens) + 1)
    )


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines; a column whose name ends in ">" is right-aligned (numbers)."""
    names = [name.removesuffix(">") for name in columns]
    rules = ["---:" if name.endswith(">") else "---" for name in columns]
    return [
        f"| {' | '.join(names)} |",
        f"|{'|'.join(rules)}|",
        *(f"| {' | '.join(cells)} |" for cells in rows),
    ]


def _best_split(rows: list[tuple[Run, Result]]) -> tuple[Run, Result]:
    return max(
        (row for row in rows if row[0].placement.kind == "split"),
        key=lambda row: row[1].steps_per_hour,
    )


def policy_report(rows: list[tuple[Run, Result]]) -> str:
    """Steps per hour and what they cost, each over Tandem's synchronous row of its cluster."""
    lines = []
    base = 0.0
    for run, result in rows:
        if run.label == "Tandem: colocate k=0":
            base = result.steps_per_hour
        carry = "carry/stale_token_share" in result.steps[-1]
        mean = result.mean_after_first
        lines.append(
            [
                str(run.placement.gpus),
                run.label,
                f"{result.steps_per_hour:.1f}",
                f"{result.steps_per_hour / base:.2f}x",
                f"{result.rollout_idle:.2f}, {result.trainer_idle:.2f}",
                _pct(result.reprefilled_tokens, result.generated_tokens),
                f"{mean('carry/stale_token_share'):.2f}" if carry else "-",
                (
                    f"{mean('carry/trained_mean_tokens') / mean('carry/finished_mean_tokens'):.2f}"
                    if carry
                    else "-"
                ),
            ]
        )
    columns = [
        "H100s>",
        "system: placement, mode",
        "steps/hour>",
        "over colocate k=0>",
        "idle: rollout, trainer",
        "prefixes prefilled again>",
        "stale token share (carry)>",
        "trained / finished mean length (carry)>",
    ]
    return "\n".join(_table(columns, lines))


def gpu_report(rows: list[tuple[Run, Result]]) -> tuple[str, dict]:
    columns = [
        "model, GPU", "GPUs>", "colocate k=0>", "colocate k=1>",
        "best split k=1 (rollout:trainer)>", "best / colocate k=0>",
        "idle: rollout, trainer, all GPUs (colocate k=1)",
    ]  # fmt: skip
    table: list[list[str]] = []
    series: dict = {}
    for key in dict.fromkeys((run.cost.model.name, run.cost.gpu.name) for run, _ in rows):
        for gpus in sorted({run.placement.gpus for run, _ in rows}):
            cell = [
                (run, res)
                for run, res in rows
                if (run.cost.model.name, run.cost.gpu.name) == key and run.placement.gpus == gpus
            ]
            sync = next(res for run, res in cell if run.schedule.max_staleness == 0)
            colo = next(
                res
                for run, res in cell
                if run.placement.kind == "colocate" and run.schedule.max_staleness
            )
            split_run, split = _best_split(cell)
            best = max(colo.steps_per_hour, split.steps_per_hour)
            placement = split_run.placement
            table.append([
                f"{key[0]}, {key[1]}", str(gpus), f"{sync.steps_per_hour:.1f}",
                f"{colo.steps_per_hour:.1f}",
                f"{split.steps_per_hour:.1f} ({placement.rollout_gpus}:{placement.trainer_gpus})",
                f"{best / sync.steps_per_hour:.2f}x",
                f"{colo.rollout_idle:.2f}, {colo.trainer_idle:.2f}, {colo.gpu_idle:.2f}",
            ])  # fmt: skip
            for name, value in (
                ("colocate k=0", sync),
                ("colocate k=1", colo),
                ("best split k=1", split),
            ):
                series.setdefault(key, {}).setdefault(name, []).append((gpus, value.steps_per_hour))
    return "\n".join(_table(columns, table)), series


def staleness_report(rows: list[tuple[Run, Result]]) -> tuple[str, dict]:
    columns = [
        "placement", "k>", "partial rollouts", "steps/hour>", "idle: rollout, trainer, all GPUs",
        "tokens by staleness 0 / 1 / ...", "prefixes prefilled again>", "preemptions>",
    ]  # fmt: skip
    table: list[list[str]] = []
    series: dict = {}
    for run, res in rows:
        s = run.schedule
        table.append([
            run.placement.label(), str(s.max_staleness), s.partial_rollout,
            f"{res.steps_per_hour:.1f}",
            f"{res.rollout_idle:.2f}, {res.trainer_idle:.2f}, {res.gpu_idle:.2f}",
            _staleness(res), _pct(res.reprefilled_tokens, res.generated_tokens),
            str(res.preemptions),
        ])  # fmt: skip
        modes = ("finish", "abort", "interrupt") if s.max_staleness == 0 else (s.partial_rollout,)
        for mode in modes:
            series.setdefault(run.placement.label(), {}).setdefault(mode, []).append(
                (s.max_staleness, res.steps_per_hour)
            )
    return "\n".join(_table(columns, table)), series


def abort_report(
    rows: list[tuple[Run, Result]], staleness: list[tuple[Run, Result]]
) -> tuple[str, dict]:
    """Colocated, per k: finish, abort at a fixed point, abort at "auto", interrupt."""
    colocated = [row for row in [*staleness, *rows] if row[0].placement.kind == "colocate"]
    columns = ["k>", "partial rollouts", "steps/hour>", "prefixes prefilled again>"]
    table: list[list[str]] = []
    series: dict = {}
    order = ("finish", "abort every", "abort", "interrupt")  # auto is plain "abort"
    for k in (1, 2, 4):
        at_k = [row for row in colocated if row[0].schedule.max_staleness == k]
        for run, res in sorted(at_k, key=lambda row: _mode_rank(row[0], order)):
            label = run.schedule.label().split(" ", 1)[1]
            if label == "abort":
                label = "abort, auto (95th percentile)"
            table.append([
                str(k), label, f"{res.steps_per_hour:.1f}",
                _pct(res.reprefilled_tokens, res.generated_tokens),
            ])  # fmt: skip
            series.setdefault(f"k={k}", {})[label] = res.steps_per_hour
    return "\n".join(_table(columns, table)), series


def _mode_rank(run: Run, order: tuple[str, ...]) -> int:
    label = run.schedule.label().split(" ", 1)[1]
    return next(i for i, mode in enumerate(order) if label.startswith(mode))


def dynamic_report(rows: list[tuple[Run, Result]]) -> tuple[str, dict]:
    columns = [
        "placement", "schedule", "dynamic sampling", "steps/hour>",
        "groups generated a step (256 kept)>", "tokens dropped>", "idle: rollout, trainer",
    ]  # fmt: skip
    table: list[list[str]] = []
    series: dict = {}
    for run, res in rows:
        s = run.schedule
        generated = res.mean_after_first("rollout/generated_groups")
        on = f"up to {s.dynamic_sampling_rounds} draws" if s.dynamic_sampling_rounds else "off"
        table.append([
            run.placement.label(), s.label(), on, f"{res.steps_per_hour:.1f}",
            f"{generated:.0f}", _pct(res.dropped_tokens, res.generated_tokens),
            f"{res.rollout_idle:.2f}, {res.trainer_idle:.2f}",
        ])  # fmt: skip
        series.setdefault(f"{run.placement.label()}, {s.label()}", {})[on] = res.steps_per_hour
    return "\n".join(_table(columns, table)), series


def sequence_parallel_report(rows: list[tuple[Run, Result]]) -> str:
    """A trainer rank's memory for the longest sample against the GPU's, what the
    all-to-alls cost, and the run's speed, by degree (rows: `sequence_parallel_sweep`)."""
    columns = [
        "trainer.sequence_parallel", f"trainer rank, a {LONG_SAMPLE:,}-token sample (GB)>",
        "fits 80 GB", "all-to-all link", "all-to-all, share of training a sample>",
        "steps/hour>",
    ]  # fmt: skip
    table = []
    for run, res in rows:
        cost, gpus = run.cost, run.placement.trainer_gpus
        n = cost.sequence_parallel
        memory = cost.trainer_rank_bytes(LONG_SAMPLE, gpus)
        fits = memory <= cost.gpu.memory_bytes
        # One sample on its group: each rank's FLOPs and all-to-alls for its 1/n.
        exchange = cost.all_to_all_s(cost.all_to_all_bytes(LONG_SAMPLE / n))
        training = cost.train_s([LONG_SAMPLE], n)
        link = "-" if n == 1 else "NVLink" if n <= cost.gpu.gpus_per_node else "network"
        table.append([
            str(n), f"{memory / 1e9:.1f}", "yes" if fits else "no", link,
            f"{100 * exchange / training:.1f}%" if n > 1 else "-",
            f"{res.steps_per_hour:.2f}" if fits else "-",
        ])  # fmt: skip
    return "\n".join(_table(columns, table))


def calibration_report(rows: list[tuple[Run, Result]]) -> tuple[str, dict]:
    """One table of step times per trainer model (rows: `calibration_runs`)."""
    sync = rows[0][1]
    step_s = {run.label: 3600 / res.steps_per_hour for run, res in rows}
    published = {
        SYNC_LABEL: verl.SYNC_STEP_S,
        STREAM_LABEL: verl.STREAM_STEP_S,
        ASYNC_LABEL: verl.ASYNC_STEP_S,
    }
    steps = []
    for label, seconds in step_s.items():
        theirs = published.get(label)
        speedup = step_s[SYNC_LABEL] / seconds
        steps.append([
            label, f"{seconds:.0f}", f"{theirs:.0f}" if theirs else "-",
            f"{100 * (seconds / theirs - 1):+.0f}%" if theirs else "-", f"{speedup:.2f}x",
            f"{verl.SYNC_STEP_S / theirs:.2f}x" if theirs else "-",
        ])  # fmt: skip
    columns = [
        "configuration", "simulated step s>", "verl's step s>", "error>",
        "simulated speed-up over sync>", "verl's>",
    ]  # fmt: skip
    lines = _table(columns, steps)
    phases = [
        ("generation", "perf/busy_s_generate", verl.SYNC_GEN_S),
        ("old log-probs", "perf/busy_s_logprobs", verl.SYNC_LOGPROB_S),
        ("update", "perf/busy_s_train", verl.SYNC_UPDATE_S),
    ]
    phase_rows = []
    for name, key, theirs in phases:
        ours = sync.mean_after_first(key)
        phase_rows.append(
            [name, f"{ours:.0f}", f"{theirs:.0f}", f"{100 * (ours / theirs - 1):+.0f}%"]
        )
    lines += ["", "The synchronous step's phases:", ""]
    lines += _table(["phase", "simulated s>", "verl's s>", "error>"], phase_rows)
    return "\n".join(lines), {
        label: (seconds, published.get(label)) for label, seconds in step_s.items()
    }


# -- plots ----------------------------------------------------------------------------------------


def plot_lines(
    panels: dict[str, dict[str, list[tuple[float, float]]]], path: Path, xlabel: str, log_x: bool
) -> None:
    """One panel per title, one line per label, steps per hour up."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False, sharey=not log_x
    )
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        for label, points in lines.items():
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("steps/hour (simulated)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(series: dict, path: Path, title: str, ylabel: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(series)
    bars = list(dict.fromkeys(bar for values in series.values() for bar in values))
    width = 0.8 / len(bars)
    for i, bar in enumerate(bars):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [series[name].get(bar, 0) for name in names], width, label=bar)
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the whole set ----------------------------------------------------------------------------------

SWEEPS = {
    "gpus": gpu_sweep,
    "staleness": staleness_sweep,
    "abort": abort_sweep,
    "dynamic": dynamic_sampling_sweep,
    "policies": policy_sweep,
    "sequence-parallel": sequence_parallel_sweep,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=Path, help="a trace of response lengths to replay")
    parser.add_argument("--only", choices=[*SWEEPS, "calibration"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    workload = reasoning()
    if args.lengths:
        lengths = read_lengths(args.lengths)
        workload = dataclasses.replace(
            workload, length=Replay(lengths, workload.group_size, workload.max_tokens)
        )
    # The abort points' report sets them against the staleness sweep's "auto" rows.
    wanted = {args.only, "staleness"} if args.only == "abort" else {args.only}
    runs = [
        run
        for name, sweep in SWEEPS.items()
        if None in wanted or name in wanted
        for run in sweep(workload)
    ]
    if args.only in (None, "calibration"):
        median, sync = verl.fit_median()
        runs += calibration_runs(median, sync)
    results = run_all(runs, args.workers)
    elapsed = time.perf_counter() - start
    by_sweep: dict[str, list] = {}
    for run, result in zip(runs, results, strict=True):
        by_sweep.setdefault(run.sweep, []).append((run, result))
    sections = {}
    if "gpus" in by_sweep:
        sections["gpus"], gpu_series = gpu_report(by_sweep["gpus"])
    if "staleness" in by_sweep:
        sections["staleness"], staleness_series = staleness_report(by_sweep["staleness"])
    if "abort" in by_sweep and "staleness" in by_sweep:
        sections["abort"], abort_series = abort_report(by_sweep["abort"], by_sweep["staleness"])
    if "dynamic" in by_sweep:
        sections["dynamic"], dynamic_series = dynamic_report(by_sweep["dynamic"])
    if "policies" in by_sweep:
        sections["policies"] = policy_report(by_sweep["policies"])
    if "sequence-parallel" in by_sweep:
        sections["sequence-parallel"] = sequence_parallel_report(by_sweep["sequence-parallel"])
    if "calibration" in by_sweep:
        sections["calibration-median"] = (
            f"Fitted median response length: **{median} tokens** (sigma 1, cap 28,672)."
        )
        sections["calibration"], calibration_series = calibration_report(by_sweep["calibration"])
        sections["calibration-trainer"], trainer_series = calibration_report(
            by_sweep["calibration-trainer"]
        )
    footer = f"{len(runs)} simulated runs in {elapsed:.0f} s on {args.workers} processes."
    for name, text in sections.items():
        print(f"## {name}\n\n{text}\n")
    print(footer)
    if not args.write_docs:
        return
    if args.lengths:
        raise ValueError(
            "--write-docs publishes the long-tailed distribution's sweeps, not a trace's"
        )
    for name, text in sections.items():
        write_section(f"simulate-{name}", text, DOC)
    if args.only is None:  # the footer counts the whole set
        write_section("simulate-footer", footer, DOC)
    if "gpus" in sections:
        panels = {f"{model} on {gpu}": lines for (model, gpu), lines in gpu_series.items()}
        plot_lines(panels, DOC.parent / "scale_gpus.png", "GPUs", log_x=True)
    if "staleness" in sections:
        panels = {
            f"Qwen2.5-7B, 128 H100, {placement}": {
                f"partial rollouts: {mode}": points for mode, points in lines.items()
            }
            for placement, lines in staleness_series.items()
        }
        plot_lines(panels, DOC.parent / "scale_staleness.png", "max staleness k", log_x=False)
    if "abort" in sections:
        plot_bars(
            abort_series,
            DOC.parent / "scale_abort_points.png",
            "Partial rollouts, Qwen2.5-7B, 128 H100 colocated",
            "steps/hour (simulated)",
        )
    if "dynamic" in sections:
        plot_bars(
            dynamic_series,
            DOC.parent / "scale_dynamic_sampling.png",
            "Dynamic sampling, Qwen2.5-7B, 128 H100",
            "steps/hour (simulated)",
        )
    if "calibration" in sections:
        bars = {
            label.split(": ")[1]: {
                "simulated, FLOPs trainer": ours,
                "simulated, verl's trainer speed": trainer_series[label][0],
                **({"verl published": theirs} if theirs else {}),
            }
            for label, (ours, theirs) in calibration_series.items()
        }
        plot_bars(
            bars,
            DOC.parent / "scale_calibration.png",
            "verl's fully-async runs, 128 H20: step seconds",
            "seconds a step",
        )


if __name__ == "__main__":
    main()
