"""On-policy distillation on CPU: the teacher, then the student distilled from it against the
same student trained by GRPO alone, side by side (recipes/distill_addition_cpu.yaml).

    .venv/bin/python bench/distill.py teacher [--steps 1000] [--every 50] [--from RUN_DIR]
    .venv/bin/python bench/distill.py compare [--steps 1000] [--every 10] [--tables-only]
                                              [key=value ...]

teacher: the demo's base (recipes/grpo_addition_cpu.yaml) trained further by the demo's GRPO
for --steps steps, a checkpoint and a held-out evaluation every --every; the checkpoint of the
best evaluation is exported (`rl export`) to the distillation recipe's teacher.path. --from
takes an earlier run of exactly that (its run directory) instead of training again.

compare: builds the recipe's student base if it is missing (`rl build-base`), measures the
teacher's held-out greedy accuracy with `rl eval` on the engine the runs evaluate with, then
runs the recipe as written (distillation mixed with the task reward), the recipe as pure
distillation (the task reward's weight 0) and the same recipe without a teacher
(teacher.path='', algorithm.distill_coef=0: GRPO alone on the task reward), each for --steps
steps with a held-out evaluation every --every; key=value overrides go to every run. Prints
markdown: each run's accuracy at every evaluation, and the first step at which it reached
90% of the teacher's accuracy and a few lower marks. The runs are named by the student's
model.path (another student: model.path=... base.hidden_size=... as overrides), and
--tables-only prints the tables from a student's runs already under .cache/bench/runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from scratch import clear_run

from rl.config.recipe import load_config
from rl.data.loading import split_dir

REPO = Path(__file__).resolve().parents[1]
DEMO = "recipes/grpo_addition_cpu.yaml"
RECIPE = "recipes/distill_addition_cpu.yaml"
OUTPUT = ".cache/bench/runs"
TARGET = 0.9  # of the teacher's held-out accuracy
MARKS = (0.6, 0.65, 0.7, 0.75)  # lower accuracies whose first step is reported too
COMMON = [
    f"run.output_dir={OUTPUT}",
    "run.wandb_mode=disabled",
    "run.tensorboard=false",
    "run.export_hf=false",
]


def rl(*args: str, quiet: bool = True) -> str:
    """`rl ARGS` as a user runs it, from the repository; its standard output."""
    result = subprocess.run(
        [sys.executable, "-m", "rl.cli", *args],
        cwd=REPO,
        check=True,
        text=True,
        stdout=subprocess.PIPE,
    )
    if not quiet:
        print(result.stdout, end="", flush=True)
    return result.stdout


def train(recipe: str, name: str, overrides: list[str]) -> list[dict]:
    """`rl train` from an empty run directory; its metrics records."""
    args = [*COMMON, *overrides, f"run.name={name}"]
    run_dir = clear_run(load_config(REPO / recipe, args))
    rl("train", recipe, *args)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def recorded(name: str) -> list[dict]:
    """The metrics records of the benchmark's run `name` as it stands."""
    lines = (REPO / OUTPUT / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def accuracies(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}


def teacher(args: argparse.Namespace) -> None:
    if args.run_dir is None:
        overrides = [
            f"run.num_steps={args.steps}",
            f"run.eval_every={args.every}",
            f"checkpoint.every={args.every}",
            f"checkpoint.keep_last={args.steps // args.every}",
        ]
        train(DEMO, "bench-distill-teacher", overrides)
        run_dir = REPO / OUTPUT / "bench-distill-teacher"
    else:
        run_dir = Path(args.run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    evaluated = accuracies([json.loads(line) for line in lines])
    saved = {int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")}
    # The best evaluation that has its checkpoint; the earliest of equals.
    step = max(sorted(saved & evaluated.keys()), key=lambda s: evaluated[s])
    out = REPO / load_config(REPO / RECIPE).teacher.path
    shutil.rmtree(out, ignore_errors=True)
    rl("export", str(run_dir / "checkpoints" / f"step_{step:06d}"), "--to", str(out))
    print(f"teacher: step {step} of {run_dir} ({evaluated[step]:.1%} held-out) exported to {out}")
    print("held-out accuracy by step: " + ", ".join(f"{s}: {a:.1%}" for s, a in evaluated.items()))


def teacher_accuracy(extra: list[str]) -> float:
    """The teacher's held-out greedy accuracy, by `rl eval` on the runs' engine and prompts."""
    cfg = load_config(REPO / RECIPE, extra)
    out = rl(
        "eval",
        cfg.teacher.path,
        "--task",
        cfg.data.task,
        "--data",
        str(REPO / split_dir(cfg.data) / "test.jsonl"),
        "--max-new-tokens",
        str(cfg.rollout.max_new_tokens),
        "--engine",
        cfg.rollout.engine,
    )
    return float(re.search(r"greedy accuracy ([\d.]+)%", out)[1]) / 100


def compare(args: argparse.Namespace, extra: list[str]) -> None:
    cfg = load_config(REPO / RECIPE, extra)
    if not Path(cfg.model.path).exists():
        rl("build-base", RECIPE, *extra)
    base = json.loads((Path(cfg.model.path) / "base_info.json").read_text())
    goal = TARGET * teacher_accuracy(extra)
    overrides = [f"run.num_steps={args.steps}", f"run.eval_every={args.every}", *extra]
    pure = [*overrides, "reward.terms=[{name: task, weight: 0}]"]
    alone = [*overrides, "teacher.path=''", "algorithm.distill_coef=0"]
    # Runs are named by their student, so measuring another student keeps the last one's runs.
    name = f"bench-distill-{Path(cfg.model.path).name}"
    measured = {
        "distillation + task reward (the recipe)": (name, overrides),
        "pure distillation (task weight 0)": (f"{name}-pure", pure),
        "GRPO alone (no teacher)": (f"{name}-grpo", alone),
    }
    runs = {
        label: recorded(name) if args.tables_only else train(RECIPE, name, runs_overrides)
        for label, (name, runs_overrides) in measured.items()
    }
    print(
        f"{datetime.date.today()}: `.venv/bin/python bench/distill.py compare "
        f"--steps {args.steps} --every {args.every}{''.join(' ' + e for e in extra)}`"
    )
    print(
        f"student base: {base['num_parameters']:,} parameters, {base['greedy_accuracy']:.1%} "
        f"held-out; target: {goal:.1%} (90% of the teacher's {goal / TARGET:.1%})\n"
    )
    marks = [*MARKS, goal]
    print(
        "| run | best (step) | "
        + " | ".join(f"first step at {mark:.1%}" for mark in marks)
        + " |\n|---|---|"
        + "---:|" * len(marks)
    )
    for name, records in runs.items():
        evaluated = accuracies(records)
        best = max(evaluated, key=evaluated.get)
        firsts = [next((str(s) for s, a in evaluated.items() if a >= m), "-") for m in marks]
        print(f"| {name} | {evaluated[best]:.1%} ({best}) | {' | '.join(firsts)} |")
    for name, records in runs.items():
        curve = ", ".join(f"{s}: {a:.1%}" for s, a in accuracies(records).items())
        print(f"\n{name}: {curve}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    one = sub.add_parser("teacher")
    one.add_argument("--steps", type=int, default=1000)
    one.add_argument("--every", type=int, default=50)
    one.add_argument("--from", dest="run_dir", help="an earlier teacher run's directory")
    two = sub.add_parser("compare")
    two.add_argument("--steps", type=int, default=1000)
    two.add_argument("--every", type=int, default=10)
    two.add_argument(
        "--tables-only", action="store_true", help="no runs: tables of the runs already there"
    )
    args, extra = parser.parse_known_args()
    if args.stage == "teacher":
        teacher(args)
    else:
        compare(args, extra)


if __name__ == "__main__":
    main()
