"""Weight transports: how a bucket gets from the trainer ranks to the rollout TP ranks. Weights
never travel as RPC arguments: only bucket indices and a channel's spec do.

Members of a sync channel are numbered trainer ranks first (0..W-1), then rollout replica r's
TP rank t as W + r * T + t. Every transport's channel offers `write(bucket, local_rows)` (a
trainer rank's FSDP2 rows) and `read(bucket)` (full-shaped tensors, of which vLLM's loaders copy
out only this rank's region). A transport is one file (shared_memory.py, gathered.py,
distributed.py) with its channel and its spec, registered in `TRANSPORTS` with its traits as
that file is imported; rl.sync.selection imports them all and chooses one for a run.
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
