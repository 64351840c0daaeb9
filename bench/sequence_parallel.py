"""Peak activation memory per trainer rank of one training step with Ulysses sequence
parallelism (trainer.sequence_parallel) against without, and the longest sample each trains
within a fixed memory budget (issue 49).

    .venv/bin/python bench/sequence_parallel.py [--length 16384] [--budget-mib 400] [--step 1024] [--no-search]
    .venv/bin/python bench/sequence_parallel.py --packed 8 --no-search

A random model of the demo's shape (recipes/grpo_addition_cpu.yaml's `base`: Qwen2, 2 layers,
hidden 128, 4 heads, 2 key/value heads, MLP 1024, the byte-level vocabulary) trains on one
sample of `--length` tokens, fp32, 2 gloo ranks on CPU, FSDP2 over both:
- `sp1`: trainer.sequence_parallel=1, two data-parallel ranks; the sample is whole on one rank
  (the other runs a copy of it with an empty loss mask, as a rank without rows does, so that
  it takes part in the collectives: its peak is the same);
- `sp2`: trainer.sequence_parallel=2, one group; each rank holds half of the sample's positions.

Each measurement is one forward and backward (`PolicyTrainer.accumulate_gradients`) in fresh
rank processes. Per rank, two measures of the memory the step adds:
- `allocated`: the most bytes torch allocated on CPU during the step that were live at once
  (every allocation and free within the step, recorded by torch.profiler with profile_memory,
  summed in order): activations, gradients, the gathered parameters and the all-to-all
  buffers. The profiler does not see the frees of memory allocated before the step, so this
  is never below the step's true rise;
- `resident`: the rise of the process's peak resident memory (VmHWM, reset just before the step)
  over its resident memory then (after freed heap memory was handed back with malloc_trim):
  what the kernel sees, allocator caching and the communication library's buffers included.
The reported figure of a run is its larger rank's.

With `--packed K` the step's `--length` tokens are one sample of half of them and K samples
sharing the other half: two packed rows as wide as the long sample, the second holding K
samples (packed rows attend within each sample: `kernels.attention.packed_attention`).

The budget search (`--budget-mib`): for each degree, the longest sample (a multiple of `--step`
tokens) whose measured `allocated` peak fits the budget: the longest length measured to fit,
next to a length one `--step` longer measured not to (`longest_within`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
import yaml
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rl.algorithms.objective import Objective
from rl.config import BaseBuildConfig, Config
from rl.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rl.types import Batch
from trainer.hf_model import new_model, save_hf_atomic, train_tokenizer
from trainer.policy import PolicyTrainer

MIB = 2**20
DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_addition_cpu.yaml"
PROMPT_TOKENS = 256  # the sample's prompt; the rest is its response, which the loss covers


def write_model(directory: Path) -> int:
    """A random checkpoint of the demo's base shape at `directory`; its parameter count."""
    base = BaseBuildConfig.model_validate(yaml.safe_load(DEMO_RECIPE.read_text())["base"])
    tokenizer = train_tokenizer(
        (f"{a}+{b}" for a in range(100) for b in range(100)), base.vocab_size
    )
    model = new_model(base, tokenizer, seed=0)
    save_hf_atomic(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def trainer_config(model_dir: Path, sequence_parallel: int, num_samples: int = 1) -> Config:
    """Two ranks of one thread each, a micro-batch of the step's `num_samples` samples packed,
    the GRPO loss without a reference model (no KL term: the policy alone)."""
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "trainer": {
                "num_workers": 2,
                "num_threads": 1,
                "packing": True,
                "micro_batch_size": num_samples,
                "sequence_parallel": sequence_parallel,
            },
            "algorithm": {"kl_coef": 0.0},
            "run": {"verbose": True, "prompts_per_step": 1, "seed": 0},
        }
    )


def sample_lengths(length: int, packed: int) -> list[int]:
    """`length` tokens as one sample, or (`packed` K > 0) one of half of them and K sharing
    the other half."""
    if not packed:
        return [length]
    half = length // 2
    return [half] + [half // packed + (i < half % packed) for i in range(packed)]


def samples(lengths: list[int], vocab_size: int) -> Batch:
    """Random sequences of `lengths` tokens, right-padded: up to PROMPT_TOKENS of prompt (half
    of a shorter one), the rest response with advantage 1; old log-probs those of a uniform
    policy (a random model's are near it)."""
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    attention_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(0, vocab_size, (len(lengths), width), generator=gen)
    input_ids *= attention_mask
    prompts = torch.tensor([min(PROMPT_TOKENS, n // 2) for n in lengths])[:, None]
    steps = torch.arange(1, width)
    loss_mask = ((steps >= prompts) & attention_mask[:, 1:].bool()).float()
    uniform = loss_mask * -math.log(vocab_size)
    return Batch(input_ids, attention_mask, loss_mask, uniform, uniform.clone(), loss_mask.clone())


def allocated_peak(prof: profile) -> int:
    """The most bytes allocated on CPU within the profiled window that were live at once (the
    profiler records no free of memory allocated before the window)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == DeviceType.CPU:
            live += event.nbytes()  # negative for a free
            peak = max(peak, live)
    return peak


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _return_freed_heap() -> None:
    """Hand freed heap memory back to the kernel (the trainer's ranks keep up to 256 MiB of
    it: rl.observe.memory.reuse_freed_host_memory), so that the step's resident rise starts
    from what is live."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rank_main(
    rank: int, model_dir: Path, sp: int, lengths: list[int], port: int, out: Path
) -> None:
    transformers.utils.logging.disable_progress_bar()
    cfg = trainer_config(model_dir, sp, len(lengths))
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    batch = samples(lengths, trainer.policy.model.config.vocab_size)
    _return_freed_heap()
    dist.barrier()
    before = rss_bytes()
    reset_peak_rss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        metrics = trainer.accumulate_gradients(batch)
    resident = peak_rss_bytes() - before
    result = {"allocated": allocated_peak(prof), "resident": resident, "loss": metrics["loss"]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.close()


def measure(model_dir: Path, sp: int, length: int, packed: int = 0) -> dict:
    """One step of `length` tokens (`sample_lengths`) at sequence_parallel `sp` in fresh
    ranks -> the larger rank's `allocated` and `resident` peaks (bytes), each rank's, and the
    step's loss."""
    lengths = sample_lengths(length, packed)
    with tempfile.TemporaryDirectory(prefix="sp-bench-") as tmp:
        out = Path(tmp)
        mp.spawn(_rank_main, args=(model_dir, sp, lengths, free_port(), out), nprocs=2)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    result = {
        "allocated": max(r["allocated"] for r in ranks),
        "resident": max(r["resident"] for r in ranks),
        "loss": ranks[0]["loss"],
        "ranks": ranks,
    }
    each = " / ".join(f"{r['allocated'] / MIB:.1f}" for r in ranks)
    print(
        f"sp{sp} {length:>6} tokens: allocated {result['allocated'] / MIB:8.1f} MiB "
        f"(ranks {each}), resident {result['resident'] / MIB:8.1f} MiB",
        flush=True,
    )
    return result


def longest_within(
    model_dir: Path, sp: int, budget: int, step: int, known: dict[int, dict]
) -> tuple[int, dict]:
    """The longest multiple of `step` tokens whose measured `allocated` peak at `sp` is at
    most `budget` bytes, and every measurement made: a bracket [longest that fits, shortest
    that does not] narrowed to `step`. Each next length to measure is read off the line
    through the two nearest measurements (the peak grows about linearly with the length),
    so a few runs settle it; the answer rests on the two measurements around it. `known`:
    measurements at `sp` already made, by length."""
    runs = dict(known)

    def peak(length: int) -> int:
        if length not in runs:
            runs[length] = measure(model_dir, sp, length)
        return runs[length]["allocated"]

    if peak(step) > budget:
        return 0, runs
    while True:
        fits = max(length for length in runs if runs[length]["allocated"] <= budget)
        too_long = min((length for length in runs if length > fits), default=None)
        if too_long is not None and too_long - fits <= step:
            return fits, runs
        # The line through the longest fitting length and its nearest measured neighbour.
        other = too_long or max((length for length in runs if length < fits), default=None)
        slope = 0.0 if other is None else (peak(other) - peak(fits)) / (other - fits)
        guess = fits + (budget - peak(fits)) / slope if slope > 0 else 2 * fits
        guess = max(fits + step, int(guess) // step * step)
        if too_long is not None:
            guess = min(too_long - step, guess)
        peak(guess)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=16384, help="tokens of the compared sample")
    parser.add_argument(
        "--budget-mib", type=float, default=400.0, help="the memory budget of the search"
    )
    parser.add_argument("--step", type=int, default=1024, help="granularity of the search")
    parser.add_argument("--no-search", action="store_true", help="compare at --length only")
    parser.add_argument(
        "--packed", type=int, default=0, help="K: half the tokens in K samples packed in a row"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sp-bench-model-") as tmp:
        model_dir = Path(tmp) / "model"
        num_params = write_model(model_dir)
        print(f"model: {num_params:,} parameters", flush=True)
        sp1, sp2 = (measure(model_dir, sp, args.length, args.packed) for sp in (1, 2))
        report = {
            "length": args.length,
            "samples": sample_lengths(args.length, args.packed),
            "num_parameters": num_params,
            "sp1": sp1,
            "sp2": sp2,
            "allocated_ratio": sp2["allocated"] / sp1["allocated"],
            "resident_ratio": sp2["resident"] / sp1["resident"],
        }
        print(json.dumps(report, indent=2), flush=True)
        if args.no_search:
            return
        budget = int(args.budget_mib * MIB)
        search = {"budget": budget}
        for sp in (1, 2):
            known = {args.length: sp1 if sp == 1 else sp2}
            longest, runs = longest_within(model_dir, sp, budget, args.step, known)
            search[f"sp{sp}"] = {"longest": longest, "runs": runs}
            print(f"sp{sp}: longest within {budget / MIB:.1f} MiB: {longest} tokens", flush=True)
        print(json.dumps(search, indent=2), flush=True)


if __name__ == "__main__":
    main()
