"""What deterministic overlap costs: this tree's scheduler against an earlier commit's, side by
side in one run.

    .venv/bin/python bench/determinism.py --baseline COMMIT [--steps 60] [--seeds 0 1]
                                          [--abort-every 4]

The baseline is checked out as a git worktree under .cache/bench/ and run with this venv
(PYTHONPATH points the driver and its Ray workers at its code). For each seed and recipe (the
demo, recipes/grpo_addition_cpu.yaml, and bench/recipes/time_to_accuracy.yaml), `rl train`
runs at max_staleness 1 for --steps steps, interleaved so the machine's drift hits all alike:
the baseline with partial_rollout finish and abort (an interrupt at each sync, then), this
tree with finish, abort (at `scheduler.abort_every` = --abort-every tokens) and interrupt.
Prints markdown for docs/benchmarks.md: median seconds per step (`time/step_s`, evaluation
steps left out), steps per hour, the ratio to the baseline's mode of the same kind, the
pool's overlap and the held-out accuracy at the end.
"""

from __future__ import annotations

import argparse
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
RECIPES = {"demo": "recipes/grpo_addition_cpu.yaml", "tta": "bench/recipes/time_to_accuracy.yaml"}


def worktree(commit: str) -> Path:
    """A checkout of `commit` (made once, reused)."""
    path = REPO / ".cache" / "bench" / f"tree-{commit[:12]}"
    if not path.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True
        )
    return path


def run(tree: Path, recipe: str, name: str, overrides: list[str]) -> dict:
    """`rl train` from `tree`'s code on this tree's base and run directory; returns the run's
    step metrics and wall seconds."""
    cfg = load_config(REPO / recipe, overrides)
    args = [
        *overrides,
        f"run.name={name}",
        f"model.path={(REPO / cfg.model.path).resolve()}",
        f"run.output_dir={(REPO / cfg.run.output_dir).resolve()}",
        "run.wandb_mode=disabled",
        "run.export_hf=false",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
    ]
    run_dir = clear_run(load_config(REPO / recipe, args))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", str(REPO / recipe), *args],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall_s = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in records if r["step"] > 0], "wall_s": wall_s}


def summary(result: dict) -> dict:
    steps = [r for r in result["records"] if "eval/accuracy" not in r]
    accuracy = [r["eval/accuracy"] for r in result["records"] if "eval/accuracy" in r]
    return {
        "s_per_step": statistics.median(r["time/step_s"] for r in steps),
        "overlap": statistics.median(r["perf/overlap_fraction"] for r in steps),
        "accuracy": accuracy[-1] if accuracy else None,
        "wall_s": result["wall_s"],
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="commit with the earlier scheduler")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--abort-every", type=int, default=4)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--modes", nargs="+", default=["finish", "abort", "interrupt"])
    args = parser.parse_args(argv)
    baseline = worktree(args.baseline)
    # (code, partial_rollout, the baseline's mode it is compared with); the baseline's abort
    # interrupted generation at each sync.
    runs = [
        ("baseline", "finish", "finish"),
        ("current", "finish", "finish"),
        ("baseline", "abort", "abort"),
        ("current", "abort", "abort"),
        ("current", "interrupt", "abort"),
    ]
    runs = [run_ for run_ in runs if run_[2] in args.modes or run_[1] in args.modes]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for seed in args.seeds:
        for recipe in args.recipes:
            for code, partial, _ in runs:
                overrides = [
                    f"run.num_steps={args.steps}",
                    f"run.seed={seed}",
                    f"run.eval_every={args.steps}",
                    "scheduler.max_staleness=1",
                    f"scheduler.partial_rollout={partial}",
                ]
                if code == "current" and partial == "abort":
                    overrides.append(f"scheduler.abort_every={args.abort_every}")
                name = f"bench-determinism-{recipe}-{partial}-{code}-s{seed}"
                tree = baseline if code == "baseline" else REPO
                result = summary(run(tree, RECIPES[recipe], name, overrides))
                results.setdefault((recipe, partial, code), []).append(result)
                print(name, json.dumps(result), flush=True)
    print(f"\nbaseline: {args.baseline}; {args.steps} steps at max_staleness 1, seeds {args.seeds}")
    print(
        "\n| recipe | partial_rollout | code | median s/step (per seed) | steps/hour "
        "| vs baseline | overlap | accuracy at the end (per seed) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    against = {(code, partial): mode for code, partial, mode in runs}
    for (recipe, partial, code), measured in results.items():
        s_per_step = statistics.mean(r["s_per_step"] for r in measured)
        reference = results[recipe, against[code, partial], "baseline"]
        base = statistics.mean(r["s_per_step"] for r in reference)
        per_seed = ", ".join(f"{r['s_per_step']:.3f}" for r in measured)
        accuracy = ", ".join(
            "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}" for r in measured
        )
        overlap = statistics.mean(r["overlap"] for r in measured)
        print(
            f"| {recipe} | {partial} | {code} | {s_per_step:.3f} ({per_seed}) "
            f"| {3600 / s_per_step:,.0f} | {base / s_per_step:.2f}x | {overlap:.0%} | {accuracy} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
