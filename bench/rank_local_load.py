"""Peak host memory per trainer rank at start-up: rank-local loading against every rank loading
the whole checkpoint (issue 34).

    .venv/bin/python bench/rank_local_load.py [--shape 0.5b|tiny] [--ranks 2]

Writes a random checkpoint of Qwen2.5-0.5B's shape in bf16 (as Qwen publishes it) to a
temporary directory, then starts `--ranks` FSDP2 ranks on gloo twice, each time in fresh
processes:
- `whole`: each rank loads the whole checkpoint with `from_pretrained` in fp32 and shards it
  (the trainer's loading before rank-local loading);
- `rank_local`: `trainer.fsdp.load_sharded`, the trainer's loading now: meta device, shard,
  each rank reads its own rows.

Per rank: how far its peak resident memory rose above its resident memory just before loading
(its VmHWM high-water mark; imports and the process group came before), and the seconds the
load took. The target: at most half the model in fp32 plus one decoder layer, per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from gpu_suite import SHAPES, free_port
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl.config import Config
from trainer.fsdp import decoder_layers, load_sharded, shard_with_fsdp
from trainer.ranks import init_rank

MIB = 2**20
VARIANTS = ("whole", "rank_local")


def write_checkpoint(shape: dict, directory: Path) -> dict[str, int]:
    """A random bf16 checkpoint of `shape` (one safetensors file, tied weights once, as
    save_pretrained writes it); returns the model's and one decoder layer's fp32 bytes."""
    from safetensors.torch import save_file

    config = Qwen2Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.randn(p.shape, generator=gen) * 0.02).bfloat16()
        for name, p in model.named_parameters()
    }
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return {"model_fp32": 4 * sum(t.numel() for t in tensors.values()), "layer_fp32": 4 * layer}


def high_water_mark() -> int:
    """This process's peak resident bytes (VmHWM). Not getrusage's ru_maxrss, which a spawned
    process inherits from its parent's size when it forked (here: the parent that wrote the
    checkpoint) and so can read higher than anything the rank itself touched."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _load_whole(cfg: Config, mesh: object) -> torch.nn.Module:
    """The trainer's loading before rank-local loading: the whole checkpoint, then FSDP2."""
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    shard_with_fsdp(model, decoder_layers(model, cfg.model.path), mesh, "float32", cfg.trainer)
    return model


def _rank_main(rank: int, variant: str, model_dir: Path, ranks: int, port: int, out: Path) -> None:
    cfg = Config.model_validate(
        {"model": {"path": str(model_dir)}, "trainer": {"num_workers": ranks, "num_threads": 1}}
    )
    transformers.utils.logging.disable_progress_bar()
    _, mesh = init_rank(rank, ranks, "127.0.0.1", port, cfg.trainer)
    dist.barrier()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if variant == "whole":
        model = _load_whole(cfg, mesh)
    else:
        model = load_sharded(cfg.model, cfg.trainer, mesh, trainable=True)
    seconds = time.perf_counter() - start
    peak = high_water_mark()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = {"rise": peak - before, "seconds": seconds, "local_shards": local}
    (out / f"{variant}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rank-local-load-") as tmp:
        tmp = Path(tmp)
        (tmp / "model").mkdir()
        sizes = write_checkpoint(SHAPES[args.shape], tmp / "model")
        for variant in VARIANTS:
            mp.spawn(
                _rank_main,
                args=(variant, tmp / "model", args.ranks, free_port(), tmp),
                nprocs=args.ranks,
            )
        results = {
            v: [json.loads((tmp / f"{v}.rank{r}.json").read_text()) for r in range(args.ranks)]
            for v in VARIANTS
        }
    target = sizes["model_fp32"] / args.ranks + sizes["layer_fp32"]
    print(
        f"Qwen2.5-{args.shape} shape, bf16 checkpoint, {args.ranks} gloo ranks on "
        f"{os.cpu_count()} cores; model {sizes['model_fp32'] / MIB:,.0f} MiB in fp32, one decoder "
        f"layer {sizes['layer_fp32'] / MIB:,.0f} MiB; target per rank: 1/{args.ranks} of the "
        f"model + one layer = {target / MIB:,.0f} MiB\n"
    )
    print("| loading | rank | peak rise, MiB | its shards, MiB | vs target | load, s |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant, ranks in results.items():
        for rank, r in enumerate(ranks):
            print(
                f"| {variant} | {rank} | {r['rise'] / MIB:,.0f} | {r['local_shards'] / MIB:,.0f} "
                f"| {r['rise'] / target:.2f}x | {r['seconds']:.1f} |"
            )
    whole = max(r["rise"] for r in results["whole"])
    local = max(r["rise"] for r in results["rank_local"])
    verdict = "met" if local <= target else "missed"
    print(f"\nlargest rank's peak rise: rank_local / whole = {local / whole:.2f}; target {verdict}")


if __name__ == "__main__":
    main()
