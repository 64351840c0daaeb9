"""The distributed transport (across hosts, or GPUs of their own): a process group over every
member (rl.sync.peer_group), gloo on CPU and NCCL on GPUs; each trainer rank sends each
rollout rank exactly the bytes of its regions it owns (rl.sync.pieces), straight from its
shard: a resharding without any all-gather, device to device on GPUs. Not pipelined: the
sends of a bucket complete as the receivers take them.

On GPUs the pieces never pass through host memory; NCCL needs the messages between two
ranks in one order, which the plan gives: a trainer rank sends a bucket's pieces to the
rollout ranks by member number, buckets in order, and a rollout rank receives them from the
trainer ranks by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.sync.peer_group import PeerGroup
from rl.sync.pieces import (
    buffer_device,
    max_piece_numel,
    pack_piece,
    piece_numel,
    unpack_pieces,
)
from rl.sync.plan import WeightSyncPlan
from rl.sync.transport import TRANSPORTS, SyncSite


class DistributedChannel:
    """Its buffers are allocated once and reused, as the shared-memory slots are: a trainer
    rank's packed pieces, a rollout rank's received pieces and one bucket's tensors."""

    def __init__(
        self, plan: WeightSyncPlan, addr: str, port: int, member: int, num_replicas: int
    ) -> None:
        self._plan, self._member = plan, member
        self._num_replicas = num_replicas
        device = buffer_device()
        world_size = plan.world_size + num_replicas * plan.tp_size
        self._group = PeerGroup(addr, port, member, world_size, device)
        kind = {"dtype": getattr(torch, plan.wire_dtype), "device": device}
        if member < plan.world_size:  # a trainer rank: one packing buffer per TP rank
            self._packed = [
                torch.empty(max_piece_numel(plan, member, t), **kind) for t in range(plan.tp_size)
            ]
        else:
            self._tp_rank = (member - plan.world_size) % plan.tp_size
            self._received = [
                torch.empty(max_piece_numel(plan, w, self._tp_rank), **kind)
                for w in range(plan.world_size)
            ]
            self._bucket = torch.empty(plan.slot_numel, **kind)

    def write(
        self, bucket: int, local_rows: dict[str, torch.Tensor], replicas: list[int] | None
    ) -> None:
        plan, rank = self._plan, self._member
        # Only to the engines being updated: a send nobody receives would never complete.
        replicas = range(self._num_replicas) if replicas is None else replicas
        pieces = [
            pack_piece(plan, bucket, rank, t, local_rows, self._packed[t])
            for t in range(plan.tp_size)
        ]
        self._group.send(
            [
                (plan.world_size + replica * plan.tp_size + t, pieces[t])
                for replica in replicas
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


@dataclass(frozen=True)
class DistributedSpec:
    addr: str  # trainer rank 0's node, which hosts the group's rendezvous
    port: int
    num_replicas: int  # rollout engines, each with the plan's tp_size members

    def open(self, plan: WeightSyncPlan, member: int) -> DistributedChannel:
        return DistributedChannel(plan, self.addr, self.port, member, self.num_replicas)

    def remove(self) -> None:
        """A gloo group leaves nothing behind its processes."""


@TRANSPORTS.register("distributed", joined_together=True)
def distributed_spec(site: SyncSite) -> DistributedSpec:
    return DistributedSpec(site.addr, site.port, site.num_replicas)
