"""The shared-memory weight transport: trainer ranks write their rows of a bucket into one
shared buffer; rollout ranks hand vLLM views of it. Plain tensor code (no Ray, no vLLM).

Two buffers ("slots"), files under /dev/shm that every process on the host maps: bucket i goes
to slot i % 2, so the trainer fills bucket i + 1 while the rollout ranks still read bucket i.
In a slot each tensor of the bucket lies whole: rank w's rows land at their place, so a reader
sees full tensors without any gather, and vLLM's loaders copy out only their rank's region.
Weights never travel as RPC arguments: only bucket indices do.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rl.weight_plan import WeightSyncPlan, owned_rows

NUM_SLOTS = 2
SHM_DIR = Path("/dev/shm")


def slot_paths(prefix: str) -> list[str]:
    """The files of the sync channel `prefix`."""
    return [str(SHM_DIR / f"{prefix}-slot{slot}") for slot in range(NUM_SLOTS)]


def create_slots(prefix: str, numel: int) -> list[torch.Tensor]:
    """Create (or truncate) the channel's files to `numel` fp32 elements and map them."""
    paths = slot_paths(prefix)
    for path in paths:
        with open(path, "wb") as f:
            os.ftruncate(f.fileno(), numel * 4)
    return open_slots(paths, numel)


def open_slots(paths: list[str], numel: int) -> list[torch.Tensor]:
    """Map existing slot files shared: a write by one process is seen by all."""
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"weight-sync slot {path} is missing: the trainer and this rollout worker must "
                "share one host (and its /dev/shm) for the shared-memory transport"
            )
    return [torch.from_file(path, shared=True, size=numel, dtype=torch.float32) for path in paths]


def remove_slots(prefix: str) -> None:
    """Delete the channel's files (idempotent; also after a crash)."""
    for path in slot_paths(prefix):
        Path(path).unlink(missing_ok=True)


def write_rows(
    slot: torch.Tensor,
    plan: WeightSyncPlan,
    bucket: int,
    rank: int,
    local_rows: dict[str, torch.Tensor],
) -> None:
    """Copy trainer `rank`'s rows of every tensor of `bucket` (`local_rows[name]`: its FSDP2
    shard, any dtype and device) to their place in `slot`."""
    for spec, offset in zip(plan.buckets[bucket], plan.offsets(bucket), strict=True):
        start, stop = owned_rows(spec.num_rows, rank, plan.world_size)
        local = local_rows[spec.name]
        assert local.numel() == (stop - start) * spec.num_cols, (spec, tuple(local.shape))
        first = offset + start * spec.num_cols
        slot[first : first + local.numel()].copy_(local.reshape(-1))


def bucket_tensors(
    slot: torch.Tensor, plan: WeightSyncPlan, bucket: int
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `bucket` as full-shaped views of `slot` (no copy)."""
    return [
        (spec.name, slot[offset : offset + spec.num_rows * spec.num_cols].view(spec.shape))
        for spec, offset in zip(plan.buckets[bucket], plan.offsets(bucket), strict=True)
    ]
