"""Every CPU algorithm recipe for the same number of steps, side by side.

    .venv/bin/python bench/algorithms.py [num_steps] [key=value ...]

Runs `rl train` on each recipe below (they share the demo's SFT base), then prints a
markdown table for docs/benchmarks.md: held-out greedy accuracy before and after, the last
steps' mean training reward, and median seconds per step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scratch import clear_run

from rl.config.recipe import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = [
    ("GRPO", "recipes/grpo_addition_cpu.yaml"),
    ("Dr.GRPO", "recipes/dr_grpo_addition_cpu.yaml"),
    ("DAPO", "recipes/dapo_addition_cpu.yaml"),
    ("RLOO", "recipes/rloo_addition_cpu.yaml"),
    ("REINFORCE++", "recipes/reinforce_pp_addition_cpu.yaml"),
    ("PPO (critic)", "recipes/ppo_addition_cpu.yaml"),
]


def main(argv: list[str]) -> None:
    num_steps = int(argv[0]) if argv and "=" not in argv[0] else 100
    extra = [a for a in argv if "=" in a]
    overrides = [
        f"run.num_steps={num_steps}",
        "run.eval_every=0",
        "run.output_dir=runs/bench-algorithms",
        # On-policy, as docs/benchmarks.md measured them: the comparison is of algorithms,
        # not of how stale their samples are (the recipes overlap, max_staleness 1).
        "scheduler.max_staleness=0",
        *extra,
    ]
    rows = []
    for label, recipe in RECIPES:
        cfg = load_config(recipe, overrides)
        clear_run(cfg)
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "rl.cli", "train", recipe, *overrides],
            cwd=REPO,
            check=True,
        )
        wall_s = time.perf_counter() - start
        metrics = Path(cfg.run.output_dir) / cfg.run.name / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
        steps = [r for r in records if r["step"] > 0]
        last = steps[-10:]
        rows.append(
            f"| {label} | `{recipe}` | {evals[0]:.1%} | {evals[-1]:.1%} | "
            f"{statistics.mean(r['reward/mean'] for r in last):.3f} | "
            f"{statistics.median(r['time/step_s'] for r in steps):.2f} | {wall_s:.0f} |"
        )
    print(f"\n{num_steps} steps each, overrides: `{' '.join(overrides)}`\n")
    print(
        "| algorithm | recipe | accuracy before | after | reward (last 10 steps) | s/step | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
