"""Trainer tokens/s with packing and token-budget micro-batches against padding with fixed
micro-batches, side by side in one run.

    .venv/bin/python bench/trainer_batching.py [--rounds 3] [--tokens 4096] [--write-docs]
                                               [key=value ...]

The model and workload of bench/recipes/throughput_25m.yaml (a random ~25M Qwen2 in bf16
compute, 32 prompts x 8 samples) on 2 FSDP2 ranks of one thread (`TWO_RANKS`), with response
lengths drawn uniformly from [max_new_tokens / 4, max_new_tokens]: a 4x spread. Each side is
the driver's PolicyRanks (real Ray actors, FSDP2 on gloo) running train_step on the same batch:

- padded: trainer.micro_batch_size sequences per micro-batch, in order, padded to the longest;
- budget: trainer.micro_batch_tokens=--tokens, rows dealt to the ranks by Karmarkar-Karp, each
  rank's longest first, padded;
- packed: the same budget with trainer.packing=true.

The groups live at once and take turns each round (1 warm-up + --rounds timed). Trained
tokens/s counts real tokens (prompt + response, no padding), the same for both sides. Results
go to .cache/bench/trainer_batching.json; --write-docs puts the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import ray
import torch
from bare_components import WholeMachine, timed_rounds
from docs_section import write_section
from transformers import AutoConfig, AutoTokenizer

from rl.base.build import ensure_base
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.config.recipe import load_config
from rl.data.loading import load_examples
from rl.data.prompts import encode_prompts
from rl.run.batching import build_batch
from rl.types import Batch, fresh_samples
from trainer.micro_batching import pack_rows, plan_micro_batches

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "bench" / "recipes" / "throughput_25m.yaml"
# Balancing rows across ranks is half of what this measures; the recipe itself runs one rank.
TWO_RANKS = ["trainer.num_workers=2", "trainer.num_threads=1", "trainer.sharding=zero3"]
RESULTS = REPO / ".cache" / "bench" / "trainer_batching.json"
TARGET = 1.5  # packed / padded tokens/s the issue asks for
SPREAD = 4  # longest / shortest response


def spread_batch(cfg: Config, prompts: list[list[int]], pad_id: int, vocab: int) -> Batch:
    """group_size samples per prompt, responses of random non-special tokens whose lengths are
    uniform in [max_new_tokens / SPREAD, max_new_tokens] (fixed seed); GRPO-like advantages."""
    gen = torch.Generator().manual_seed(0)
    samples = fresh_samples(prompts, cfg.algorithm.group_size, list(range(len(prompts))))
    longest = cfg.rollout.max_new_tokens
    for sample in samples:
        length = int(torch.randint(longest // SPREAD, longest + 1, (1,), generator=gen))
        sample.response_ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        sample.logprobs = [-float(torch.log(torch.tensor(vocab)))] * length
    batch = build_batch(samples, pad_id)
    batch.advantages = torch.randn(len(samples), 1, generator=gen) * batch.loss_mask
    return batch


def side(cfg: Config, batch: Batch, **trainer: object):
    """A PolicyRanks with `trainer` overrides and its round function (real tokens trained)."""
    cfg = cfg.model_copy(deep=True)
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    group = PolicyRanks(cfg, WholeMachine(cfg, 1), num_roles_sharing=1)
    inside: list[float] = []

    def step() -> int:
        inside.append(group.train_step(batch)["timing/train_tokens_per_s"])
        return int(batch.attention_mask.sum())

    return group, step, inside


def recipe_batch(recipe: Path, run_name: str, overrides: list[str]) -> tuple[Config, Batch]:
    """`recipe` with `overrides` (its base built if missing) and `spread_batch` over its first
    step's prompts; the trainer ranks to come get the recipe's threads."""
    cfg = load_config(recipe, [f"run.name={run_name}", *overrides])
    os.chdir(REPO)  # the recipe's paths are relative to the repo root
    ensure_base(cfg)
    os.environ["OMP_NUM_THREADS"] = str(cfg.trainer.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, "train").dataset
    prompts = encode_prompts(tokenizer, examples[: cfg.run.prompts_per_step]["prompt"])
    vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size
    return cfg, spread_batch(cfg, prompts, tokenizer.pad_token_id, vocab)


def run_sides(
    cfg: Config, batch: Batch, trainers: dict[str, dict], rounds: int
) -> tuple[dict[str, dict], dict[str, float]]:
    """A PolicyRanks per side (its trainer.* overrides in `trainers`), all alive at once and
    taking turns on `batch` (`timed_rounds`); returns the runs and each side's median tokens/s
    inside its ranks (the PolicyRanks's Ray overhead left out)."""
    # Every side's ranks exist at once: a logical CPU for each.
    ray.init(
        address="local",
        num_cpus=len(trainers) * cfg.trainer.num_workers,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        sides = {name: side(cfg, batch, **overrides) for name, overrides in trainers.items()}
        runs = timed_rounds({name: step for name, (_, step, _) in sides.items()}, rounds)
    finally:
        ray.shutdown()
    inside = {name: statistics.median(rates[1:]) for name, (_, _, rates) in sides.items()}
    return runs, inside


# side -> (its trainer.* overrides given the token budget, how it cuts micro-batches)
SIDES = {
    "padded": (
        lambda tokens: {"packing": False, "micro_batch_tokens": 0},
        "trainer.micro_batch_size sequences in order, padded to the longest",
    ),
    "budget": (
        lambda tokens: {"packing": False, "micro_batch_tokens": tokens},
        "token budget, longest first, ranks balanced (KK), padded",
    ),
    "packed": (
        lambda tokens: {"packing": True, "micro_batch_tokens": tokens},
        "token budget, ranks balanced (KK), packed",
    ),
}


def positions(lengths: list[int], cfg: Config, packing: bool, micro_batch_tokens: int) -> int:
    """Token positions the decoder computes for the batch over all ranks: each micro-batch's
    rows x its longest, or its packed rows x their width (the plan the trainer follows)."""
    plan = plan_micro_batches(
        lengths, cfg.trainer.num_workers, cfg.trainer.micro_batch_size, micro_batch_tokens, packing
    )
    total = 0
    for micro in (micro for rank in plan for micro in rank):
        sizes = [lengths[row] for row in micro]
        total += (
            len(pack_rows(sizes, max(lengths))) * max(lengths)
            if packing
            else len(sizes) * max(sizes)
        )
    return total


def table(results: dict) -> str:
    runs, config = results["runs"], results["config"]
    padded = runs["padded"]["tokens_per_s"]
    rows = [
        f"| side ({config['num_ranks']} ranks, micro_batch_size {config['micro_batch_size']}, "
        f"budget {config['tokens']} tokens) | positions computed (real {results['real_tokens']:,}) "
        "| trained tokens/s | / padded | target |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (_, label) in SIDES.items():
        tokens_per_s = runs[name]["tokens_per_s"]
        target = f">= {TARGET:g}x" if name == "packed" else ""
        rows.append(
            f"| {name}: {label} | {results['positions'][name]:,} | {tokens_per_s:,.0f} "
            f"| {tokens_per_s / padded:.2f}x | {target} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    parser.add_argument("--tokens", type=int, default=4096, help="packed side's token budget")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = parser.parse_args()
    cfg, batch = recipe_batch(RECIPE, "bench-trainer-batching", [*TWO_RANKS, *args.overrides])
    num_ranks = cfg.trainer.num_workers
    trainers = {name: overrides(args.tokens) for name, (overrides, _) in SIDES.items()}
    runs, inside = run_sides(cfg, batch, trainers, args.rounds)
    lengths = batch.attention_mask.sum(dim=1)
    results = {
        "config": {
            "rounds": args.rounds,
            "tokens": args.tokens,
            "micro_batch_size": cfg.trainer.micro_batch_size,
            "num_ranks": num_ranks,
            "dtype": cfg.model.dtype,
        },
        "sequences": batch.num_sequences,
        "real_tokens": int(lengths.sum()),
        "shortest": int(lengths.min()),
        "longest": int(lengths.max()),
        "runs": runs,
        "positions": {
            name: positions(lengths.tolist(), cfg, **overrides(args.tokens))
            for name, (overrides, _) in SIDES.items()
        },
        # the ranks' own tokens/s (PolicyRanks's Ray overhead left out)
        "inside_rank_tokens_per_s": inside,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = table(results)
    print(text)
    if args.write_docs:
        write_section("trainer_batching", text)
    print(f"raw results: {RESULTS}")


if __name__ == "__main__":
    main()
