"""Peak trainer memory and step time per strategy, one rank, on the lent GPU.

    python bench/gpu_strategies.py           # CUDA: a Qwen2.5-0.5B shape, under 5 minutes
    python bench/gpu_strategies.py --tiny    # a tiny shape on any machine (checks the script)

Each strategy builds its own PolicyTrainer (one rank, bf16 compute over fp32 master weights)
on the same random batch, whose response lengths vary 4x, and runs 1 warm-up and --steps
train steps. The table gives the step time and `memory/trainer_peak_mb`: allocated CUDA memory
at its peak (resident memory on CPU). One GPU means one rank, so hybrid sharding (which needs
replicas) is not among them, and zero2 against zero3 differs only in the gathered layers.

The last row is zero3 again, its state released to host memory after every step as in colocate
mode (`PolicyTrainer.release_memory`) and brought back by the next: the allocated memory held
between steps, with and without the release, and whether the released run's parameters after
its steps equal the plain run's (parameter checksums).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from gpu_suite import SHAPES, build_model, free_port

from rl.algorithms.objective import Objective
from rl.config import Config
from rl.types import Batch
from trainer.policy import PolicyTrainer

# label -> trainer.* overrides over the base (zero3, activation checkpointing, fixed).
STRATEGIES = {
    "zero3": {},
    "zero2": {"sharding": "zero2"},
    "none": {"sharding": "none"},
    "zero3 + CPU offload": {"offload": True},
    "zero3, no activation checkpointing": {"activation_checkpointing": False},
    "zero3 + token budget + packing": {"packing": True},
}
RELEASED = "zero3, released between steps"


def config(model_dir: Path, args: argparse.Namespace, overrides: dict) -> Config:
    trainer = {
        "num_workers": 1,
        "lr": 1e-6,
        "micro_batch_size": args.micro_batch_size,
        "logprob_chunk_size": 4096,
        "activation_checkpointing": True,
        **overrides,
    }
    if trainer.get("packing"):  # a budget of the fixed micro-batch's padded positions
        width = args.prompt_tokens + args.new_tokens
        trainer["micro_batch_tokens"] = args.micro_batch_size * width
    return Config.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "rollout": {"max_model_len": args.prompt_tokens + args.new_tokens},
            "trainer": trainer,
            "algorithm": {"group_size": 8, "kl_coef": 0.0},
        }
    )


def spread_batch(args: argparse.Namespace, vocab: int) -> Batch:
    """Random prompts and responses of new_tokens / 4 to new_tokens tokens, GRPO-like
    advantages; old and behaviour log-probs are 0 (their values change neither memory nor
    speed)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(
        args.new_tokens // 4, args.new_tokens + 1, (args.sequences,), generator=gen
    )
    width = args.prompt_tokens + args.new_tokens
    steps = torch.arange(width)
    attention_mask = (steps < (args.prompt_tokens + lengths)[:, None]).long()
    input_ids = torch.randint(1, vocab, (args.sequences, width), generator=gen) * attention_mask
    loss_mask = ((steps[1:] >= args.prompt_tokens) & (attention_mask[:, 1:] == 1)).float()
    zeros = torch.zeros_like(loss_mask)
    advantages = torch.randn(args.sequences, 1, generator=gen) * loss_mask
    return Batch(input_ids, attention_mask, loss_mask, zeros, zeros, advantages)


def allocated_mb() -> float:
    """CUDA memory allocated now (NaN on CPU, where a release has nothing to free)."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")


def measure(
    model_dir: Path, args: argparse.Namespace, overrides: dict, batch: Batch, release: bool = False
) -> dict:
    cfg = config(model_dir, args, overrides)
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), 0, 1, "127.0.0.1", free_port())
    seconds, peaks = [], []
    held_mb = released_mb = float("nan")
    for step in range(1 + args.steps):
        start = time.perf_counter()
        metrics = trainer.train_step(batch)  # brings a released state back first
        if step:  # step 0 warms up
            seconds.append(time.perf_counter() - start)
            peaks.append(metrics["memory/trainer_peak_mb"])
        held_mb = allocated_mb()
        if release:
            trainer.release_memory()
            released_mb = allocated_mb()
    checksum = trainer.parameter_checksum()
    trainer.close()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "s_per_step": sum(seconds) / len(seconds),
        "peak_mb": max(peaks),
        "held_mb": held_mb,
        "released_mb": released_mb,
        "checksum": checksum,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (any machine)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.sequences, args.prompt_tokens, args.new_tokens = 1, 8, 4, 16
        args.micro_batch_size = 4
    shape = SHAPES["tiny" if args.tiny else "0.5b"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(shape, Path(tmp) / "model")
        batch = spread_batch(args, shape["vocab_size"])
        results = {label: measure(model_dir, args, o, batch) for label, o in STRATEGIES.items()}
        results[RELEASED] = measure(model_dir, args, {}, batch, release=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (resident memory)"
    print(f"\n{device}, {args.sequences} sequences of {args.prompt_tokens} + "
          f"{args.new_tokens // 4}-{args.new_tokens} tokens, one rank\n")  # fmt: skip
    print("| strategy | s/step | peak memory (MiB) | held between steps | after release |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['s_per_step']:.2f} | {r['peak_mb']:,.0f} | {r['held_mb']:,.0f} "
              f"| {r['released_mb']:,.0f} |")  # fmt: skip
    plain, released = results["zero3"]["checksum"], results[RELEASED]["checksum"]
    print(f"\nparameter checksum after the steps: zero3 {plain:.10e}, released {released:.10e} "
          f"(relative difference {abs(released - plain) / plain:.1e})")  # fmt: skip


if __name__ == "__main__":
    main()
