"""Trainer tokens/s with shared prompts (`trainer.share_prompts`) against padded rows, side by
side in one run, on the time-to-accuracy workload.

    .venv/bin/python bench/prompt_sharing.py [--rounds 5] [--write-docs] [key=value ...]

The model and trainer of bench/recipes/time_to_accuracy.yaml (the ~1M SFT base, bf16 compute,
one rank of one thread, one micro-batch of 128 rows), 16 prompts x 8 samples with responses
drawn as bench/trainer_batching.py draws them (uniform in [max_new_tokens / 4,
max_new_tokens]). Each side is the driver's PolicyRanks (a real Ray actor, FSDP2 on gloo)
running train_step on the same batch, taking turns each round (1 warm-up + --rounds timed).
Positions are what the decoder computes (rows x width of every micro-batch's model input);
tokens/s counts real tokens, the same for both sides. Results go to
.cache/bench/prompt_sharing.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from docs_section import write_section
from trainer_batching import recipe_batch, run_sides

from rl.config import TrainerConfig
from rl.types import Batch
from trainer.ranks import micro_batches

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "bench" / "recipes" / "time_to_accuracy.yaml"
RESULTS = REPO / ".cache" / "bench" / "prompt_sharing.json"
SIDES = {"padded": False, "shared": True}  # side -> trainer.share_prompts


def positions(batch: Batch, cfg: TrainerConfig, share_prompts: bool) -> int:
    """Token positions the decoder computes for `batch` over every rank's micro-batches."""
    trainer = cfg.model_copy(update={"share_prompts": share_prompts})
    world = trainer.num_workers
    return sum(
        inputs.input_ids.numel()
        for rank in range(world)
        for _, inputs, _ in micro_batches(batch, rank, world, trainer, torch.device("cpu"))
    )


def table(results: dict) -> str:
    runs, padded = results["runs"], results["runs"]["padded"]["tokens_per_s"]
    rows = [
        f"| side | positions computed (real {results['real_tokens']:,}) | trained tokens/s "
        "| s/step | / padded |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in SIDES:
        run = runs[name]
        seconds = sum(run["seconds"]) / len(run["seconds"])
        rows.append(
            f"| {name} | {results['positions'][name]:,} | {run['tokens_per_s']:,.0f} "
            f"| {seconds:.3f} | {run['tokens_per_s'] / padded:.2f}x |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = parser.parse_args()
    cfg, batch = recipe_batch(RECIPE, "bench-prompt-sharing", args.overrides)
    num_ranks = cfg.trainer.num_workers
    trainers = {name: {"share_prompts": share} for name, share in SIDES.items()}
    runs, _ = run_sides(cfg, batch, trainers, args.rounds)
    results = {
        "config": {"rounds": args.rounds, "overrides": args.overrides},
        "real_tokens": int(batch.attention_mask.sum()),
        "positions": {name: positions(batch, cfg.trainer, share) for name, share in SIDES.items()},
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = (
        f"Command: `.venv/bin/python bench/prompt_sharing.py --write-docs`, {args.rounds} timed "
        f"rounds a side, {num_ranks} rank(s) of {cfg.trainer.num_threads} thread(s), "
        f"{batch.num_sequences} sequences.\n\n{table(results)}"
    )
    print(text)
    if args.write_docs:
        write_section("prompt_sharing", text)


if __name__ == "__main__":
    main()
