"""Weight transports: how a bucket gets from the trainer ranks to the rollout TP ranks.
Weights never travel as RPC arguments: only bucket indices do.

Members of a sync channel are numbered trainer ranks first (0..W-1), then rollout replica r's
TP rank t as W + r * T + t. Both transports offer `write(bucket, local_rows)` (a trainer
rank's FSDP2 rows) and `read(bucket)` (full-shaped tensors, of which vLLM's loaders copy out
only this rank's region).

shared_memory (one host): two buffers ("slots"), files under /dev/shm that every process maps.
Bucket i goes to slot i % 2, so the trainer fills bucket i + 1 while the rollout ranks still
read bucket i (`pipelined`). Each tensor lies whole in a slot: rank w's rows land at their
place, so readers see full tensors without any gather or copy.

distributed (across hosts): a gloo group over all members; each trainer rank sends each
rollout rank exactly the bytes of its regions it owns (`rl.weight_pieces`). Not pipelined:
the sends of a bucket complete as the receivers take it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rl.sync_group import SyncGroup
from rl.weight_pieces import (
    bucket_tensors,
    max_piece_numel,
    pack_piece,
    piece_numel,
    unpack_pieces,
)
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


class SharedMemoryChannel:
    pipelined = True

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


class DistributedChannel:
    """Its buffers are allocated once and reused, as the shared-memory slots are: a trainer
    rank's packed pieces, a rollout rank's received pieces and one bucket's tensors."""

    pipelined = False

    def __init__(
        self, plan: WeightSyncPlan, addr: str, port: int, member: int, num_replicas: int
    ) -> None:
        self._plan, self._member = plan, member
        self._num_replicas = num_replicas
        self._group = SyncGroup(addr, port, member, plan.world_size + num_replicas * plan.tp_size)
        if member < plan.world_size:  # a trainer rank: one packing buffer per TP rank
            self._packed = [
                torch.empty(max_piece_numel(plan, member, t)) for t in range(plan.tp_size)
            ]
        else:
            self._tp_rank = (member - plan.world_size) % plan.tp_size
            self._received = [
                torch.empty(max_piece_numel(plan, w, self._tp_rank)) for w in range(plan.world_size)
            ]
            self._bucket = torch.empty(plan.slot_numel)

    def write(self, bucket: int, local_rows: dict[str, torch.Tensor]) -> None:
        plan, rank = self._plan, self._member
        pieces = [
            pack_piece(plan, bucket, rank, t, local_rows, self._packed[t])
            for t in range(plan.tp_size)
        ]
        self._group.send(
            [
                (plan.world_size + replica * plan.tp_size + t, pieces[t])
                for replica in range(self._num_replicas)
                for t in range(plan.tp_size)
            ],
            tag=bucket,
        )

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        plan = self._plan
        pieces = [
            self._received[w][: piece_numel(plan, bucket, w, self._tp_rank)]
            for w in range(plan.world_size)
        ]
        self._group.recv(list(enumerate(pieces)), tag=bucket)
        return unpack_pieces(plan, bucket, self._tp_rank, pieces, self._bucket)


Channel = SharedMemoryChannel | DistributedChannel


def open_channel(plan: WeightSyncPlan, spec: dict, member: int) -> Channel:
    """Join the channel `spec` describes (see `channel_spec`) as `member`."""
    if spec["kind"] == "shared_memory":
        return SharedMemoryChannel(plan, spec["prefix"], member)
    return DistributedChannel(plan, spec["addr"], spec["port"], member, spec["num_replicas"])


def choose_transport(setting: str, num_nodes: int) -> str:
    """The transport for `rollout.weight_transport=setting` when the trainer and rollout
    workers span `num_nodes` nodes: shared memory on one node, a gloo group across nodes."""
    if setting == "auto":
        return "shared_memory" if num_nodes == 1 else "distributed"
    if setting == "shared_memory" and num_nodes > 1:
        raise ValueError(
            f"rollout.weight_transport=shared_memory, but the trainer and rollout workers run "
            f"on {num_nodes} nodes: use 'distributed' (or 'auto'), or place them on one node"
        )
    return setting
