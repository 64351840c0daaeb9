"""The two rollout engines (`rollout.engine`) side by side in one process, on both bench
workloads.

    .venv/bin/python bench/rollout_engines.py [--rounds 3] [--threads 2] [--write-docs]

- tiny: bench/recipes/time_to_accuracy.yaml, the ~1M SFT base, 16 prompts x 8 samples, up to
  8 new tokens (it ends most responses with EOS after 4-5);
- 25M: bench/recipes/throughput_25m.yaml, a random ~25M Qwen2, 32 prompts x 8 samples, up to
  128 new tokens ending at a sampled EOS.

Each engine is the class a RolloutWorker serves with, built from the recipe's rollout section
and dtype, and generates the recipe's first training prompts with the sampling parameters the
driver sends (the same seeds on both sides). Both engines live at once and take turns each
round (1 warm-up + --rounds timed). Reports seconds per round and response tokens/s; raw
results go to .cache/bench/rollout_engines.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from bare_components import sampling, timed_rounds
from docs_section import write_section
from transformers import AutoTokenizer

from rl.base.build import ensure_base
from rl.config import Config
from rl.config.recipe import load_config
from rl.data.loading import load_examples
from rl.data.prompts import encode_prompts
from rl.types import fresh_samples
from rollout.engines.registry import ENGINES, build_engine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / ".cache" / "bench" / "rollout_engines.json"
WORKLOADS = {
    "tiny": REPO / "bench" / "recipes" / "time_to_accuracy.yaml",
    "25M": REPO / "bench" / "recipes" / "throughput_25m.yaml",
}


def engine_round(engine: object, cfg: Config, prompts: list[list[int]]):
    """A round: every prompt's group generated to the end; returns its response tokens."""
    params = sampling(cfg)

    def run_round() -> int:
        samples = fresh_samples(prompts, params.n, list(range(len(prompts))))
        return sum(len(s.response_ids) for s in engine.generate(samples, params))

    return run_round


def measure(recipe: Path, rounds: int) -> dict:
    cfg = load_config(recipe, ["run.name=bench-rollout-engines"])
    ensure_base(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, "train").dataset
    prompts = encode_prompts(tokenizer, examples[: cfg.run.prompts_per_step]["prompt"])
    sides = {}
    for name in ENGINES.names():
        rollout = cfg.rollout.model_copy(update={"engine": name})
        engine = build_engine(cfg.model.path, rollout, cfg.model.dtype, cfg.run.seed)
        sides[name] = engine_round(engine, cfg, prompts)
    return timed_rounds(sides, rounds)


def table(results: dict) -> str:
    rows = [
        "| workload | vLLM s/round | torch s/round | vLLM tok/s | torch tok/s | torch / vLLM |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for workload, runs in results["workloads"].items():
        vllm, torch_side = runs["vllm"], runs["torch"]
        seconds = {name: sum(run["seconds"]) / len(run["seconds"]) for name, run in runs.items()}
        rows.append(
            f"| {workload} | {seconds['vllm']:.3f} | {seconds['torch']:.3f} "
            f"| {vllm['tokens_per_s']:,.0f} | {torch_side['tokens_per_s']:,.0f} "
            f"| {torch_side['tokens_per_s'] / vllm['tokens_per_s']:.2f}x |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per engine")
    parser.add_argument("--only", choices=list(WORKLOADS))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    os.chdir(REPO)  # the recipes' paths are relative to the repo root
    # Both engines read it: vLLM when it starts, the torch engine at construction.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    results = {"config": {"rounds": args.rounds, "threads": args.threads}, "workloads": {}}
    for workload, recipe in WORKLOADS.items():
        if args.only in (None, workload):
            print(f"{workload}:", flush=True)
            results["workloads"][workload] = measure(recipe, args.rounds)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = (
        f"Command: `.venv/bin/python bench/rollout_engines.py --write-docs`, {args.threads} "
        f"threads per engine, 1 warm-up + {args.rounds} timed rounds each.\n\n{table(results)}"
    )
    print(text)
    if args.write_docs:
        write_section("rollout_engines", text)


if __name__ == "__main__":
    main()
