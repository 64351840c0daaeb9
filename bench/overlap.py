"""Staleness k = 0 against k = 1 and k = 2 on the demo workload, side by side in one run.

    .venv/bin/python bench/overlap.py [--steps 100] [--seeds 0 1 2] [--ks 0 1 2]
                                      [--placements colocate split] [key=value ...]

For each seed and placement, `rl train` runs the demo recipe once per k, interleaved, so that
the machine's drift hits every k alike. Prints markdown for docs/benchmarks.md: per placement
and k, the median seconds per step, the speed-up over k = 0, the pool's busy and overlap
fractions (from the run's trace) and the held-out accuracy of every seed at each evaluation.
The trace of the first seed's k = 0 and k = 1 runs are drawn to docs/overlap_trace_k*.png, a
window of five steps from the middle of the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from render_trace import main as render_trace
from scratch import clear_run

from rl.config.recipe import load_config
from rl.observe.trace import load_chrome

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/grpo_addition_cpu.yaml"


def run(name: str, overrides: list[str]) -> tuple[list[dict], Path, float]:
    """`rl train` the demo as a user would; returns its metrics records, run dir, wall s."""
    args = [*overrides, f"run.name={name}", "run.wandb_mode=disabled"]
    args.append("run.export_hf=false")
    cfg = load_config(REPO / RECIPE, args)
    clear_run(cfg)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rl.cli", "train", RECIPE, *args], cwd=REPO, check=True)
    wall_s = time.perf_counter() - start
    run_dir = REPO / cfg.run.output_dir / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, run_dir, wall_s


def draw(run_dir: Path, out: Path, first_step: int, num_steps: int = 5) -> None:
    """The trace from the sync before `first_step` to the sync of step first_step + num_steps."""
    syncs = sorted(
        (
            s
            for s in load_chrome(run_dir / "trace.json")
            if s.phase == "sync" and s.lane == "trainer"
        ),
        key=lambda s: s.start,
    )
    begin = next(s for s in syncs if s.step == first_step - 1).start
    end = next(s for s in syncs if s.step == first_step + num_steps - 1).end
    t0 = min(s.start for s in load_chrome(run_dir / "trace.json"))
    render_trace(
        [str(run_dir / "trace.json"), str(out), "--from", str(begin - t0), "--to", str(end - t0)]
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--placements", nargs="+", default=["colocate"])
    args, overrides = parser.parse_known_args(argv)
    results: dict[tuple[str, int], list[dict]] = {}
    for placement in args.placements:
        for seed in args.seeds:
            for k in args.ks:
                name = f"bench-overlap-{placement}-k{k}-s{seed}"
                extra = [
                    f"run.num_steps={args.steps}",
                    f"run.seed={seed}",
                    f"run.eval_every={args.steps // 4}",
                    f"scheduler.max_staleness={k}",
                    f"scheduler.placement={placement}",
                ]
                if placement == "split":
                    extra.append("scheduler.trainer_devices=1")
                records, run_dir, wall_s = run(name, extra + overrides)
                steps = [r for r in records if r["step"] > 0]
                results.setdefault((placement, k), []).append(
                    {
                        "seed": seed,
                        "s_per_step": statistics.median(r["time/step_s"] for r in steps),
                        "busy": statistics.median(r["perf/busy_fraction"] for r in steps),
                        "overlap": statistics.median(r["perf/overlap_fraction"] for r in steps),
                        "accuracy": {
                            r["step"]: r["eval/accuracy"]
                            for r in records
                            if r.get("eval/accuracy") is not None
                        },
                        "wall_s": wall_s,
                    }
                )
                if seed == args.seeds[0] and k in (0, 1):
                    draw(
                        run_dir, REPO / f"docs/overlap_trace_{placement}_k{k}.png", args.steps // 2
                    )
                print(name, json.dumps(results[placement, k][-1]), flush=True)
    print_tables(results, args.ks)


def print_tables(results: dict[tuple[str, int], list[dict]], ks: list[int]) -> None:
    print("\n| placement | k | median s/step (per seed) | speed-up vs k=0 | busy | overlap |")
    print("|---|---|---|---|---|---|")
    for (placement, k), runs in results.items():
        s_per_step = statistics.mean(r["s_per_step"] for r in runs)
        base = statistics.mean(r["s_per_step"] for r in results[placement, ks[0]])
        per_seed = ", ".join(f"{r['s_per_step']:.2f}" for r in runs)
        busy = statistics.mean(r["busy"] for r in runs)
        overlap = statistics.mean(r["overlap"] for r in runs)
        print(
            f"| {placement} | {k} | {s_per_step:.2f} ({per_seed}) | {base / s_per_step:.2f}x "
            f"| {busy:.0%} | {overlap:.0%} |"
        )
    print("\n| placement | k | seed | held-out accuracy at each evaluation | wall s |")
    print("|---|---|---|---|---|")
    for (placement, k), runs in results.items():
        for r in runs:
            accuracy = ", ".join(
                f"{step}: {acc:.1%}" for step, acc in sorted(r["accuracy"].items())
            )
            print(f"| {placement} | {k} | {r['seed']} | {accuracy} | {r['wall_s']:.0f} |")
    print("\n| placement | k | final accuracy, mean ± std over seeds |")
    print("|---|---|---|")
    for (placement, k), runs in results.items():
        finals = [r["accuracy"][max(r["accuracy"])] for r in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"| {placement} | {k} | {statistics.mean(finals):.1%} ± {spread:.1%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
