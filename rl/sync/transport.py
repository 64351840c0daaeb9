"""Weight transports: how a bucket gets from the trainer ranks to the rollout TP ranks. Weights
never travel as RPC arguments: only bucket indices and a channel's spec do.

Members of a sync channel are numbered trainer ranks first (0..W-1), then rollout replica r's
TP rank t as W + r * T + t. Every transport's channel offers `write(bucket, local_rows)` (a
trainer rank's FSDP2 rows) and `read(bucket)` (full-shaped tensors, of which vLLM's loaders copy
out only this rank's region). A transport is one file (shared_memory.py, distributed.py) with
its channel and its spec, registered in `TRANSPORTS` with its traits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rl.config.registry import Registry
from rl.sync.plan import WeightSyncPlan


class Channel(Protocol):
    """One member's end of a sync channel."""

    def write(
        self, bucket: int, local_rows: dict[str, torch.Tensor], replicas: list[int] | None
    ) -> None:
        """A trainer rank's rows of `bucket` (by HF name), for rollout engines `replicas`
        (None: all); a transport whose readers share what is written ignores it."""
        ...

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        """A rollout rank's whole `bucket`, as (HF name, full-shaped tensor)."""
        ...


@runtime_checkable
class ExportingChannel(Channel, Protocol):
    """A trainer rank's end of a transport whose readers open what the writers made (device
    memory, trait `exports_slots`): `export()` says where, and the driver hands every
    rank's export to the readers (`ChannelSpec.with_exports`)."""

    def export(self) -> object: ...


class ChannelSpec(Protocol):
    """How to join one channel: a small frozen dataclass the driver sends every member."""

    def open(self, plan: WeightSyncPlan, member: int) -> Channel: ...

    def remove(self) -> None:
        """Delete what the channel leaves behind its processes (the driver calls it however
        it exits)."""
        ...


@dataclass(frozen=True)
class SyncSite:
    """What the driver knows when it opens a channel; each transport takes what it needs."""

    prefix: str  # unique to this run's channel
    addr: str  # trainer rank 0's node and a port free there
    port: int
    num_replicas: int  # rollout engines


@dataclass(frozen=True)
class TransportTraits:
    single_host: bool = False  # every member must share one host
    pipelined: bool = False  # bucket i + 1 may be written while bucket i is read
    creator_first: bool = False  # member 0 creates the channel before the others open it
    joined_together: bool = False  # all members join at once (a group): a replacement re-forms it
    # The readers open what the trainer ranks made as they opened (their slots in device
    # memory): the driver collects each rank's `export()` and opens the readers with
    # `spec.with_exports(exports)`.
    exports_slots: bool = False


TRANSPORTS: Registry[Callable[[SyncSite], ChannelSpec], TransportTraits] = Registry(
    "weight transport", TransportTraits
)


def open_channel(plan: WeightSyncPlan, spec: ChannelSpec, member: int) -> Channel:
    """Join the channel `spec` describes as `member`."""
    return spec.open(plan, member)


def choose_transport(
    setting: str, num_nodes: int, shm_free: int, shm_needed: int, on_gpu: bool, colocated: bool
) -> str:
    """The transport for `rollout.weight_transport=setting` when the trainer and rollout
    workers span `num_nodes` nodes, run on GPUs (`on_gpu`) or CPUs, share their devices
    (`colocated`), and /dev/shm has `shm_free` of the `shm_needed` bytes the shared-memory
    transport would take. On GPUs the weights never leave the devices: the gathered
    transport where trainer and engines share them on one node, else the distributed one
    (NCCL). On CPUs shared memory on one node where it fits, else the distributed one (gloo,
    which works over loopback on one node too). A too-small /dev/shm (a container's default)
    would otherwise kill the first sync with SIGBUS, once its pages run out."""
    space = (
        f"/dev/shm has {shm_free / 2**20:.1f} MiB free of the {shm_needed / 2**20:.1f} MiB "
        "the shared-memory transport needs (two slots of the largest bucket, and a margin)"
    )
    if setting == "auto":
        if num_nodes > 1:
            return "distributed"
        if on_gpu:
            return "gathered" if colocated else "distributed"
        if shm_free < shm_needed:
            print(
                f"weight sync: {space}: using the distributed (gloo) transport",
                flush=True,
            )
            return "distributed"
        return "shared_memory"
    if TRANSPORTS.traits(setting).single_host and num_nodes > 1:
        raise ValueError(
            f"rollout.weight_transport={setting}, but the trainer and rollout workers run "
            f"on {num_nodes} nodes: use 'distributed' (or 'auto'), or place them on one node"
        )
    if setting == "gathered" and on_gpu and not colocated:
        raise ValueError(
            "rollout.weight_transport=gathered reads each bucket on the GPU of a trainer rank, "
            "but scheduler.placement=split gives the engines GPUs of their own: use "
            "'distributed' (or 'auto'), or scheduler.placement=colocate"
        )
    if setting == "shared_memory" and shm_free < shm_needed:
        raise ValueError(
            f"rollout.weight_transport=shared_memory, but {space}: enlarge /dev/shm "
            "(docker run --shm-size), lower rollout.weight_bucket_mb, or use 'distributed' "
            "(or 'auto')"
        )
    return setting


# The registered transports (each registers itself on import).
from rl.sync import distributed, gathered, shared_memory  # noqa: E402, F401
