"""partial_rollout carry, and abort with the streaming trainer, against abort (abort_every
auto) at the same k = 1, and all against the synchronous run (k = 0), side by side on CPU.

    .venv/bin/python bench/carry_over.py [--steps 40] [--seeds 0 1]
                                         [--recipes demo heavy_tail]
                                         [--modes sync abort carry stream] [key=value ...]

For each seed and recipe (the demo, recipes/grpo_addition_cpu.yaml, and a workload with a
heavy length tail, bench/recipes/heavy_tail.yaml), `rl train` runs once per mode (sync:
max_staleness 0; abort, carry and stream, which is abort with scheduler.streaming:
max_staleness 1), interleaved so that the machine's drift hits every mode alike;
key=value overrides go to every run. Held-out accuracy is evaluated about four times a run
(run.eval_every = steps / 4) and before the first step.

Prints markdown for docs/benchmarks.md: per recipe and mode, the median seconds per step
(`time/step_s`, evaluation steps left out), steps per hour, the speed-up over abort, the
pool's busy and overlap fractions (medians); per run, reward/mean over the run and over its
last 10 steps and the held-out accuracy at each evaluation; and for carry the bias streaming
has (means over the steps): the length of the responses trained against that of every
response finished in the same epoch, the share of groups carried over, of stale tokens, the
oldest token and the groups dropped for their age.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scratch import clear_run

from rl.config.recipe import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"demo": "recipes/grpo_addition_cpu.yaml", "heavy_tail": "bench/recipes/heavy_tail.yaml"}
MODES = ("sync", "abort", "carry", "stream")
LAST = 10  # reward/mean is also averaged over the run's last LAST steps
CARRY_METRICS = (
    "carry/trained_mean_tokens",
    "carry/finished_mean_tokens",
    "carry/carried_groups",
    "carry/stale_token_share",
    "carry/max_token_age",
    "carry/dropped_groups",
)


def run_overrides(mode: str, seed: int, steps: int, extra: list[str]) -> list[str]:
    """The overrides of one measured run; `extra` (the command line's) come last and win.
    `mode` is a partial_rollout at max_staleness 1, "stream" (abort, the trainer streaming),
    or "sync": on-policy (k = 0), the synchronous run whose reward and accuracy per step the
    others are held against."""
    k, partial = (0, "finish") if mode == "sync" else (1, "abort" if mode == "stream" else mode)
    return [
        f"run.num_steps={steps}",
        f"run.seed={seed}",
        f"run.eval_every={max(1, steps // 4)}",
        "run.output_dir=.cache/bench/runs",
        "run.wandb_mode=disabled",
        "run.tensorboard=false",
        "run.export_hf=false",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        f"scheduler.max_staleness={k}",
        f"scheduler.partial_rollout={partial}",
        "scheduler.abort_every=auto",
        f"scheduler.streaming={str(mode == 'stream').lower()}",
        *extra,
    ]


def train(recipe: str, name: str, overrides: list[str]) -> tuple[list[dict], float]:
    """`rl train` as a user runs it, from an empty run directory; its metrics records and
    wall seconds."""
    args = [*overrides, f"run.name={name}"]
    run_dir = clear_run(load_config(REPO / recipe, args))
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", recipe, *args],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall_s = time.perf_counter() - start
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall_s


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: list[dict], wall_s: float) -> dict:
    """One run's numbers from its metrics.jsonl records (step 0: the evaluation before
    training). Timings leave out the steps that evaluated; a metric a step did not log (the
    last step of an overlapped run generates nothing) is left out of its median or mean."""
    steps = [r for r in records if r["step"] > 0]
    timed = [r for r in steps if "eval/accuracy" not in r]

    def values(rows: list[dict], key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    s_per_step = _median(values(timed, "time/step_s"))
    rewards = values(steps, "reward/mean")
    return {
        "s_per_step": s_per_step,
        "steps_per_hour": 3600 / s_per_step if s_per_step else None,
        "busy": _median(values(timed, "perf/busy_fraction")),
        "overlap": _median(values(timed, "perf/overlap_fraction")),
        "reward": _mean(rewards),
        "reward_last": _mean(rewards[-LAST:]),
        "response_tokens": _mean(values(steps, "response/mean_tokens")),
        "accuracy": {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r},
        "carry": {key: _mean(values(steps, key)) for key in CARRY_METRICS},
        "wall_s": wall_s,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tables(results: dict[tuple[str, str], list[dict]], seeds: list[int]) -> str:
    """The markdown of `results` ((recipe, mode) -> one summary per seed, in `seeds` order)."""
    out = [
        "| recipe | partial_rollout | median s/step (per seed) | steps/hour | vs abort "
        "| busy | overlap |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (recipe, mode), runs in results.items():
        s_per_step = statistics.mean(r["s_per_step"] for r in runs)
        per_seed = ", ".join(f"{r['s_per_step']:.3f}" for r in runs)
        abort = results.get((recipe, "abort"))
        versus = "-"
        if abort:
            versus = f"{statistics.mean(r['s_per_step'] for r in abort) / s_per_step:.2f}x"
        busy = statistics.mean(r["busy"] for r in runs)
        overlap = statistics.mean(r["overlap"] for r in runs)
        out.append(
            f"| {recipe} | {mode} | {s_per_step:.3f} ({per_seed}) | {3600 / s_per_step:,.0f} "
            f"| {versus} | {busy:.0%} | {overlap:.0%} |"
        )
    out += [
        "",
        f"| recipe | partial_rollout | seed | reward/mean: run, last {LAST} steps "
        "| response mean tokens | held-out accuracy at each evaluation | wall s |",
        "|---|---|---|---|---:|---|---:|",
    ]
    for (recipe, mode), runs in results.items():
        for seed, r in zip(seeds, runs, strict=True):
            accuracy = ", ".join(
                f"{step}: {acc:.1%}" for step, acc in sorted(r["accuracy"].items())
            )
            out.append(
                f"| {recipe} | {mode} | {seed} | {_fmt(r['reward'], '.3f')}, "
                f"{_fmt(r['reward_last'], '.3f')} | {_fmt(r['response_tokens'], '.1f')} "
                f"| {accuracy} | {r['wall_s']:.0f} |"
            )
    carry = {key: runs for key, runs in results.items() if key[1] == "carry"}
    if carry:
        out += [
            "",
            "| recipe | seed | trained / finished mean tokens | carried groups "
            "| stale token share | max token age | dropped groups |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for (recipe, _), runs in carry.items():
            for seed, r in zip(seeds, runs, strict=True):
                c = r["carry"]
                trained, finished = c["carry/trained_mean_tokens"], c["carry/finished_mean_tokens"]
                ratio = f" ({trained / finished:.2f})" if trained and finished else ""
                out.append(
                    f"| {recipe} | {seed} | {_fmt(trained, '.1f')} / {_fmt(finished, '.1f')}"
                    f"{ratio} | {_fmt(c['carry/carried_groups'], '.0%')} "
                    f"| {_fmt(c['carry/stale_token_share'], '.0%')} "
                    f"| {_fmt(c['carry/max_token_age'], '.2f')} "
                    f"| {_fmt(c['carry/dropped_groups'], '.2f')} |"
                )
    return "\n".join(out)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=["sync", "abort", "carry", "stream"]
    )
    args, extra = parser.parse_known_args(argv)
    results: dict[tuple[str, str], list[dict]] = {}
    for seed in args.seeds:
        for recipe in args.recipes:
            for mode in args.modes:
                name = f"bench-carry-{recipe}-{mode}-s{seed}"
                overrides = run_overrides(mode, seed, args.steps, extra)
                records, wall_s = train(RECIPES[recipe], name, overrides)
                results.setdefault((recipe, mode), []).append(summarize(records, wall_s))
                print(name, json.dumps(results[recipe, mode][-1]), flush=True)
    print(
        f"\n{datetime.date.today()}, {os.cpu_count()} CPUs: {args.steps} steps at "
        f"max_staleness 1, abort_every auto, seeds {args.seeds}, overrides {extra}\n"
    )
    print(tables(results, args.seeds))


if __name__ == "__main__":
    main(sys.argv[1:])
