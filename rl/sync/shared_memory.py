"""The shared-memory transport (one host): two buffers ("slots"), files under /dev/shm that
every member maps. Bucket i goes to slot i % 2, so the trainer fills bucket i + 1 while the
rollout ranks still read bucket i (pipelined). Each tensor lies whole in a slot: rank w's rows
land at their place, so readers see full tensors without any gather or copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rl.sync.pieces import bucket_tensors
from rl.sync.plan import WeightSyncPlan, owned_rows
from rl.sync.transport import TRANSPORTS, SyncSite

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


class SharedMemoryChannel:
    def __init__(self, plan: WeightSyncPlan, prefix: str, member: int) -> None:
        self._plan = plan
        # Member 0 (trainer rank 0) creates the files; it is opened before everyone else.
        if member == 0:
            self._slots = create_slots(prefix, plan.slot_numel)
        else:
            self._slots = open_slots(slot_paths(prefix), plan.slot_numel)
        self._member = member

    def write(self, bucket: int, local_rows: dict[str, torch.Tensor]) -> None:
        slot = self._slots[bucket % NUM_SLOTS]
        write_rows(slot, self._plan, bucket, self._member, local_rows)

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        return bucket_tensors(self._slots[bucket % NUM_SLOTS], self._plan, bucket)


@dataclass(frozen=True)
class SharedMemorySpec:
    prefix: str  # the slot files are /dev/shm/PREFIX-slot0 and -slot1

    def open(self, plan: WeightSyncPlan, member: int) -> SharedMemoryChannel:
        return SharedMemoryChannel(plan, self.prefix, member)

    def remove(self) -> None:
        remove_slots(self.prefix)


@TRANSPORTS.register("shared_memory", single_host=True, pipelined=True, creator_first=True)
def shared_memory_spec(site: SyncSite) -> SharedMemorySpec:
    return SharedMemorySpec(site.prefix)
