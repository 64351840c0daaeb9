"""How much of what a weight sync sends changed since the last sync, in the dtype on the wire:
the case for sending only changes (issue 34; verl and NeMo-RL report 1-3% of bf16 weights).

Runs `rl train` with a checkpoint after every step, exports each checkpoint's policy
(rl.checkpoint.export), and compares each version's weights, rounded to bf16, with the
previous version's (version 0: the base model). Per step: the share of elements that changed,
of rows with any change (what a row-sparse sync sends), and of 1 MiB blocks with any change,
and the bytes each way would move against the whole model.

    .venv/bin/python bench/delta_sync.py [--recipe R] [--steps 4] [key=value ...]

Any recipe runs at the demo recipe's learning rate in fp32 compute. Default: the 25M model
of bench/recipes/throughput_25m.yaml, which being random never answers the task: all its
rewards are 0 and no step has a gradient unless a shaping term gives its groups different
rewards (`algorithm.overlong_buffer=120`, then the responses shorten until none is penalised).
`--recipe recipes/grpo_addition_cpu.yaml` measures the demo itself: its SFT base and task
reward.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from scratch import clear_run

from rl.checkpoint.export import export_checkpoint
from rl.config.recipe import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = "bench/recipes/throughput_25m.yaml"
DEMO = "recipes/grpo_addition_cpu.yaml"
BLOCK_BYTES = 1 << 20
WIRE = torch.bfloat16


def changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """Counts of what changed between two versions in the wire dtype: elements, rows (dim 0;
    a 1-D tensor is one row) and blocks of BLOCK_BYTES of the flattened tensor."""
    block = BLOCK_BYTES // WIRE.itemsize
    keys = ("elements", "changed", "rows", "changed_rows", "blocks", "changed_blocks")
    out = dict.fromkeys(keys, 0.0)
    for name, new in after.items():
        differs = before[name].to(WIRE) != new.to(WIRE)
        rows = differs.reshape(differs.shape[0], -1) if differs.dim() > 1 else differs[None]
        flat = differs.flatten()
        padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block))
        out["elements"] += flat.numel()
        out["changed"] += flat.sum().item()
        out["rows"] += rows.shape[0]
        out["changed_rows"] += rows.any(dim=1).sum().item()
        out["blocks"] += padded.numel() // block
        out["changed_blocks"] += padded.reshape(-1, block).any(dim=1).sum().item()
    return out


def sync_bytes(counts: dict[str, float]) -> dict[str, float]:
    """Bytes on the wire: the whole model; each changed element with a 4-byte index; each
    changed row whole (rows average elements / rows long) with a 4-byte index."""
    row_len = counts["elements"] / counts["rows"]
    return {
        "full": counts["elements"] * WIRE.itemsize,
        "elements": counts["changed"] * (WIRE.itemsize + 4),
        "rows": counts["changed_rows"] * (row_len * WIRE.itemsize + 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="key=value over the workload's")
    args = parser.parse_args()
    lr = load_config(DEMO, []).trainer.lr
    overrides = [
        "run.name=bench-delta-sync",
        f"run.num_steps={args.steps}",
        f"trainer.lr={lr}",
        "model.dtype=float32",
        "trainer.compile=false",
        "rollout.compile=false",
        "checkpoint.every=1",
        f"checkpoint.keep_last={args.steps}",
        *args.overrides,
    ]
    cfg = load_config(args.recipe, overrides)
    run_dir = clear_run(cfg)
    if not Path(cfg.model.path).exists():
        build = [sys.executable, "-m", "rl.cli", "build-base", args.recipe]
        subprocess.run(build, cwd=REPO, check=True)
    train = [sys.executable, "-m", "rl.cli", "train", args.recipe, *overrides]
    subprocess.run(train, cwd=REPO, check=True)
    print(f"\n{args.recipe} {' '.join(args.overrides)}: lr {cfg.trainer.lr}, {args.steps} steps; "
          f"changes in {WIRE} against the version before\n")  # fmt: skip
    print("| step | elements changed | rows changed | 1 MiB blocks changed | "
          "bytes: element deltas / full | row deltas / full |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    before = load_file(Path(cfg.model.path) / "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.steps + 1):
            exported = export_checkpoint(
                run_dir / "checkpoints" / f"step_{step:06d}", Path(tmp) / f"step{step}"
            )
            after = load_file(exported / "model.safetensors")
            c = changes(before, after)
            b = sync_bytes(c)
            print(f"| {step} | {c['changed'] / c['elements']:.2%} | "
                  f"{c['changed_rows'] / c['rows']:.2%} | {c['changed_blocks'] / c['blocks']:.2%} | "
                  f"{b['elements'] / b['full']:.2f} | {b['rows'] / b['full']:.2f} |")  # fmt: skip
            before = after


if __name__ == "__main__":
    main()
