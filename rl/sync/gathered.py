"""The gathered transport (one node): every trainer rank assembles each bucket whole in memory
of its own device, by an all-gather over the trainer group, and the engine ranks on the same
device read it there. On GPUs the slots are device memory shared by CUDA IPC, so no byte
leaves the GPUs and each GPU reads only its own memory.

This is the layout of vLLM's "ipc" weight-transfer engine (each trainer rank shares full
tensors with the engine on its GPU, found by the GPU's UUID), in this project's bucket
protocol: two slots, bucket i + 1 gathered while bucket i loads; an engine left part-way
through an update refuses to serve it; a replacement opens the same slots. vLLM's engine
itself cannot be driven so: its loads bypass the engine's versioning, and a lost engine fails
the sending rank's RPC while the other ranks wait in its barrier.

On CPU the slots are host shared memory, one pair per trainer rank, and a rollout rank reads
the pair of trainer rank (its member number mod W): the same protocol, so that all of it but
the CUDA IPC calls runs in the CPU tests. The shared-memory transport is the better choice
there (no all-gather), and `auto` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rl.sync import shared_memory
from rl.sync.pieces import bucket_tensors, buffer_device
from rl.sync.plan import TensorSpec, WeightSyncPlan, owned_rows
from rl.sync.transport import TRANSPORTS, SyncSite

NUM_SLOTS = 2  # bucket i + 1 is gathered into one while bucket i is read from the other


def _row_counts(plan: WeightSyncPlan, bucket: int, rank: int) -> list[tuple[TensorSpec, int]]:
    """Each tensor of `bucket` with the number of its rows trainer `rank` holds."""
    counts = []
    for spec in plan.buckets[bucket]:
        start, stop = owned_rows(spec.num_rows, rank, plan.world_size)
        counts.append((spec, stop - start))
    return counts


def piece_numel(plan: WeightSyncPlan) -> int:
    """The all-gather's piece per rank: the most any rank holds of any bucket."""
    return max(
        sum(rows * spec.num_cols for spec, rows in _row_counts(plan, bucket, rank))
        for bucket in range(len(plan.buckets))
        for rank in range(plan.world_size)
    )


def piece_rows(
    plan: WeightSyncPlan, bucket: int, rank: int, piece: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Trainer `rank`'s piece of `bucket` as its rows of each tensor, in order (views of
    `piece`, whose tail is padding)."""
    views, position = {}, 0
    for spec, rows in _row_counts(plan, bucket, rank):
        numel = rows * spec.num_cols
        views[spec.name] = piece[position : position + numel].view(rows, *spec.shape[1:])
        position += numel
    return views


def pack_rows(
    plan: WeightSyncPlan,
    bucket: int,
    local_rows: dict[str, torch.Tensor],
    rank: int,
    out: torch.Tensor,
) -> None:
    """This rank's rows of each tensor of `bucket` into `out` (cast to its dtype)."""
    for name, view in piece_rows(plan, bucket, rank, out).items():
        view.copy_(local_rows[name].reshape(view.shape))


def place_pieces(
    plan: WeightSyncPlan, bucket: int, pieces: torch.Tensor, slot: torch.Tensor
) -> None:
    """Lay `pieces` (row w: trainer rank w's piece) out in `slot` as whole tensors, one after
    another, as every rank of the shared-memory transport writes its own rows."""
    for rank in range(plan.world_size):
        rows = piece_rows(plan, bucket, rank, pieces[rank])
        shared_memory.write_rows(slot, plan, bucket, rank, rows)


def _device_key(device: torch.device) -> str:
    """What the members on one device share: its GPU's UUID (as vLLM's ipc engine keys its
    handles), or on CPU nothing (every trainer rank's slots are host memory)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


@dataclass(frozen=True)
class SlotExport:
    """Where the members on trainer rank `rank`'s device find its slots: CUDA IPC handles
    (`torch.multiprocessing.reductions.reduce_tensor`'s rebuild arguments) on a GPU, slot
    files on CPU."""

    rank: int
    device_key: str
    handles: tuple = ()
    paths: tuple[str, ...] = ()


class GatheredWriter:
    """A trainer rank's end: gathers each bucket over the trainer group into its own slots."""

    def __init__(self, plan: WeightSyncPlan, rank: int) -> None:
        self._plan, self._rank = plan, rank
        dtype = getattr(torch, plan.wire_dtype)
        self._device = device = buffer_device()
        width = piece_numel(plan)
        self._piece = torch.zeros(width, dtype=dtype, device=device)
        self._pieces = torch.zeros(
            plan.world_size * width if plan.world_size > 1 else 0, dtype=dtype, device=device
        )
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self._slots = [
                torch.empty(plan.slot_numel, dtype=dtype, device=device) for _ in range(NUM_SLOTS)
            ]
            handles = tuple(reduce_tensor(slot)[1] for slot in self._slots)
            self.export_info = SlotExport(rank, _device_key(device), handles=handles)
        else:
            # Owned by this rank's process: a later run deletes them should it be killed.
            self._prefix = shared_memory.channel_prefix()
            self._slots = shared_memory.create_slots(self._prefix, plan.slot_numel, plan.wire_dtype)
            self.export_info = SlotExport(
                rank, "", paths=tuple(shared_memory.slot_paths(self._prefix))
            )

    def export(self) -> SlotExport:
        return self.export_info

    def write(
        self, bucket: int, local_rows: dict[str, torch.Tensor], replicas: list[int] | None
    ) -> None:
        """Collective over the trainer group (its default process group): every rank must
        write the same bucket. The engines read every slot, so `replicas` is not needed."""
        pack_rows(self._plan, bucket, local_rows, self._rank, self._piece)
        if self._plan.world_size == 1:  # this rank holds every row: nothing to gather
            pieces = self._piece.view(1, -1)
        else:
            dist.all_gather_single(self._pieces, self._piece)
            pieces = self._pieces.view(self._plan.world_size, -1)
        place_pieces(self._plan, bucket, pieces, self._slots[bucket % NUM_SLOTS])
        if self._device.type == "cuda":
            # In the slot before the driver tells the engines to read it.
            torch.cuda.current_stream(self._device).synchronize()

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        raise AssertionError("a trainer rank only writes")


class GatheredReader:
    """A rollout TP rank's end: reads whole buckets out of the slots on its own device."""

    def __init__(self, plan: WeightSyncPlan, exports: tuple[SlotExport, ...], member: int) -> None:
        self._plan = plan
        device = buffer_device()
        if device.type == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            key = _device_key(device)
            export = next((e for e in exports if e.device_key == key), None)
            if export is None:
                raise ValueError(
                    f"rollout.weight_transport=gathered: no trainer rank runs on this engine "
                    f"rank's GPU ({key}); it needs placement colocate, or use 'distributed'"
                )
            # As vLLM's ipc engine does: argument 6 is the device, in this process's numbering.
            self._slots = [
                rebuild_cuda_tensor(*args[:6], device.index, *args[7:]) for args in export.handles
            ]
        else:
            export = exports[(member - plan.world_size) % plan.world_size]
            self._slots = shared_memory.open_slots(
                list(export.paths), plan.slot_numel, plan.wire_dtype
            )

    def write(
        self, bucket: int, local_rows: dict[str, torch.Tensor], replicas: list[int] | None
    ) -> None:
        raise AssertionError("a rollout rank only reads")

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        return bucket_tensors(self._slots[bucket % NUM_SLOTS], self._plan, bucket)


@dataclass(frozen=True)
class GatheredSpec:
    """The trainer ranks open it as created; the driver then adds their exports
    (`with_exports`) for the engines to find the slots."""

    exports: tuple[SlotExport, ...] = field(default=())

    def open(self, plan: WeightSyncPlan, member: int) -> GatheredWriter | GatheredReader:
        if member < plan.world_size:
            return GatheredWriter(plan, member)
        assert len(self.exports) == plan.world_size, "the driver adds every rank's export"
        return GatheredReader(plan, self.exports, member)

    def with_exports(self, exports: list[SlotExport]) -> GatheredSpec:
        return GatheredSpec(tuple(sorted(exports, key=lambda e: e.rank)))

    def remove(self) -> None:
        """Delete the trainer ranks' slot files (CPU); device memory goes with its process."""
        for export in self.exports:
            for path in export.paths:
                Path(path).unlink(missing_ok=True)


@TRANSPORTS.register("gathered", single_host=True, pipelined=True, exports_slots=True)
def gathered_spec(site: SyncSite) -> GatheredSpec:
    return GatheredSpec()
