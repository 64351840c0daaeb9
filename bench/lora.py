"""LoRA against full fine-tuning, side by side in one run, on the demo task and on the 25M
throughput model.

    .venv/bin/python bench/lora.py [--steps 100] [--throughput-steps 6] [--rounds 2]
                                   [--write-docs]

learning    `rl train` of the demo recipe (full fine-tune) for --steps steps and of its LoRA
            recipe for twice as many, from the same SFT base, evaluated on the same 500
            held-out prompts every --steps: accuracy gains, and LoRA's as a share of the full
            one's.
throughput  bench/recipes/throughput_25m.yaml (the random ~25M Qwen2, 32 prompts x 8 samples,
            up to 128 new tokens) trained in full and with LoRA at rank 16 on every linear,
            --rounds rounds taking turns so the machine's drift hits both alike: the bytes a
            sync sends to a rollout rank against the whole model's, the sync's seconds, the
            trainer rank's peak resident memory and steps per hour (first step left out: it
            compiles).
Prints markdown for docs/benchmarks.md (--write-docs: also replaces its `lora` section).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from docs_section import write_section
from scratch import clear_run

from rl.config.recipe import load_config

REPO = Path(__file__).resolve().parents[1]
FULL_RECIPE = "recipes/grpo_addition_cpu.yaml"
LORA_RECIPE = "recipes/grpo_lora_addition_cpu.yaml"
THROUGHPUT_RECIPE = "bench/recipes/throughput_25m.yaml"
THROUGHPUT_RANK = 16
# The recipe computes in bf16, which is fast on CPUs with avx512_bf16 and emulated (a train
# step of minutes) on those without: fp32 keeps this comparison about LoRA on any CPU.
THROUGHPUT_DTYPE = "float32"


def train(recipe: str, name: str, overrides: list[str]) -> tuple[list[dict], float]:
    """`rl train` as a user runs it, under the benchmark's own run name; its metrics records
    and wall seconds."""
    args = [
        *overrides,
        f"run.name={name}",
        "run.output_dir=runs/bench-lora",
        "run.wandb_mode=disabled",
        "run.export_hf=false",
        # On-policy, as docs/benchmarks.md measured it (the recipes overlap, max_staleness 1).
        "scheduler.max_staleness=0",
    ]
    cfg = load_config(REPO / recipe, args)
    run_dir = clear_run(cfg)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rl.cli", "train", recipe, *args], cwd=REPO, check=True)
    wall_s = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, wall_s


def learning(num_steps: int) -> str:
    """The full fine-tune for `num_steps`, LoRA for twice as many (evaluated every
    `num_steps`: a seeded run's first `num_steps` are those of a run that stops there)."""
    rows, gains = [], {}
    for label, recipe, steps in (
        ("full fine-tune", FULL_RECIPE, num_steps),
        ("LoRA", LORA_RECIPE, 2 * num_steps),
    ):
        overrides = [f"run.num_steps={steps}", f"run.eval_every={num_steps}"]
        cfg = load_config(REPO / recipe, overrides)
        records, wall_s = train(recipe, f"bench-lora-learn-{label.split()[0]}", overrides)
        evals = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
        step_s = statistics.median(r["time/step_s"] for r in records if r["step"] > 0)
        lora = cfg.model.lora
        setting = f"rank {lora.rank}, alpha {lora.alpha:g}" if lora.enabled else "all weights"
        for step in range(num_steps, steps + 1, num_steps):
            gains[label, step] = evals[step] - evals[0]
            rows.append(
                f"| {label} | `{recipe}` | {setting}, lr {cfg.trainer.lr:g} | {step} | "
                f"{evals[0]:.1%} | {evals[step]:.1%} | {gains[label, step] * 100:+.1f} | "
                f"{step_s:.2f} | {wall_s:.0f} |"
            )
    full = gains["full fine-tune", num_steps]
    return "\n".join(
        [
            "From the demo's SFT base; held-out greedy accuracy on 500 prompts.",
            "",
            "| run | recipe | trains | steps | accuracy before | after | gain (points) | "
            "s/step | run wall s |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"LoRA's gain is **{gains['LoRA', num_steps] / full:.0%}** of the full fine-tune's "
            f"over the same {num_steps} steps, and {gains['LoRA', 2 * num_steps] / full:.0%} "
            f"of it after {2 * num_steps}.",
        ]
    )


def throughput(num_steps: int, rounds: int) -> str:
    overrides = [f"run.num_steps={num_steps}", f"model.dtype={THROUGHPUT_DTYPE}"]
    sides = {"full fine-tune": [], f"LoRA rank {THROUGHPUT_RANK}": []}
    for round_ in range(rounds):
        for label in sides:
            extra = [] if label.startswith("full") else [f"model.lora.rank={THROUGHPUT_RANK}"]
            name = f"bench-lora-25m-{'full' if not extra else 'lora'}-{round_}"
            records, _ = train(THROUGHPUT_RECIPE, name, overrides + extra)
            sides[label] += [r for r in records if r["step"] > 1]  # step 1 compiles
    rows, measured = [], {}
    for label, records in sides.items():
        sync_mb = statistics.median(r["weight_sync/mb_per_rollout_rank"] for r in records)
        full_mb = statistics.median(r["weight_sync/mb_full_model"] for r in records)
        sync_s = statistics.median(r["weight_sync/seconds"] for r in records)
        peak_mb = max(r["memory/trainer_peak_mb"] for r in records)
        step_s = statistics.median(r["time/step_s"] for r in records)
        train_s = statistics.median(r["timing/train_step_s"] for r in records)
        gen_tps = statistics.median(r["perf/gen_tokens_per_s"] for r in records)
        measured[label] = (sync_mb, sync_s, peak_mb, step_s)
        rows.append(
            f"| {label} | {sync_mb:.2f} | {sync_mb / full_mb:.2%} | {sync_s * 1000:.0f} | "
            f"{peak_mb:,.0f} | {train_s:.2f} | {gen_tps:,.0f} | {step_s:.2f} | "
            f"{3600 / step_s:,.0f} |"
        )
    (full_mb_sync, full_s, full_peak, full_step), (lora_mb, lora_s, lora_peak, lora_step) = (
        measured.values()
    )
    return "\n".join(
        [
            f"`{THROUGHPUT_RECIPE}` ({full_mb:.1f} MiB in fp32) computing in "
            f"{THROUGHPUT_DTYPE}, {num_steps} steps a run, "
            f"{rounds} run(s) a side taking turns; medians over steps 2 on (step 1 compiles), "
            "peak memory the largest of any step.",
            "",
            "| run | MiB a sync sends a rollout rank | of the full model | sync ms | "
            "trainer rank peak MiB | train step s | generated tokens/s | s/step | steps/hour |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"LoRA against full: sync bytes {lora_mb / full_mb_sync:.2%}, sync time "
            f"{lora_s / full_s:.2f}x, trainer peak memory {lora_peak / full_peak:.2f}x, steps "
            f"per hour {full_step / lora_step:.2f}x.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--throughput-steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    measured = throughput(args.throughput_steps, args.rounds)  # first: the shorter part
    text = "\n\n".join(
        [
            "Command: `.venv/bin/python bench/lora.py"
            f" --steps {args.steps} --throughput-steps {args.throughput_steps}"
            f" --rounds {args.rounds}`.",
            "**Learning on the demo task.** " + learning(args.steps),
            "**The 25M throughput model.** " + measured,
        ]
    )
    print(text)
    if args.write_docs:
        write_section("lora", text)


if __name__ == "__main__":
    main()
