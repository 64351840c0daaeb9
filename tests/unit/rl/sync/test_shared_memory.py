"""The shared-memory transport: FSDP2 shards written in place, whole tensors read back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from rl.sync.pieces import bucket_tensors
from rl.sync.plan import owned_rows, plan_weight_sync
from rl.sync.shared_memory import (
    NUM_SLOTS,
    SHM_DIR,
    SharedMemorySpec,
    create_slots,
    open_slots,
    remove_slots,
    slot_paths,
    write_rows,
)
from rl.sync.transport import open_channel
from tests.helpers.sync_specs import SYNC_SHAPE, SYNC_SPECS


@pytest.fixture
def prefix():
    name = f"tandem-test-{uuid.uuid4().hex[:8]}"
    yield name
    remove_slots(name)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_writing_their_rows_leave_whole_tensors_in_the_slot(
    prefix: str, world_size: int
) -> None:
    plan = plan_weight_sync(SYNC_SPECS, SYNC_SHAPE, world_size, 2, bucket_bytes=100_000)
    assert len(plan.buckets) > NUM_SLOTS  # slots are reused
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SYNC_SPECS)
    }
    writers = [create_slots(prefix, plan.slot_numel)]
    writers += [open_slots(slot_paths(prefix), plan.slot_numel) for _ in range(1, world_size)]
    reader = open_slots(slot_paths(prefix), plan.slot_numel)  # another process's mapping
    for bucket in range(len(plan.buckets)):
        for rank in range(world_size):
            shards = {
                s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, world_size))]
                for s in plan.buckets[bucket]
            }
            write_rows(writers[rank][bucket % NUM_SLOTS], plan, bucket, rank, shards)
        got = bucket_tensors(reader[bucket % NUM_SLOTS], plan, bucket)
        assert [name for name, _ in got] == [s.name for s in plan.buckets[bucket]]
        for name, tensor in got:
            assert torch.equal(tensor, full[name]), name


def test_missing_slot_files_name_the_host_requirement(prefix: str) -> None:
    with pytest.raises(FileNotFoundError, match="share one host"):
        open_slots(slot_paths(prefix), 16)


def test_remove_slots_deletes_the_channel_files(prefix: str) -> None:
    create_slots(prefix, 16)
    assert len(list(SHM_DIR.glob(f"{prefix}-*"))) == NUM_SLOTS
    remove_slots(prefix)
    assert not any(Path(p).exists() for p in slot_paths(prefix))


def test_channels_hand_readers_the_tensors_writers_wrote(prefix: str) -> None:
    plan = plan_weight_sync(SYNC_SPECS, SYNC_SHAPE, 2, 1, bucket_bytes=100_000)
    spec = SharedMemorySpec(prefix)
    writers = [open_channel(plan, spec, member=rank) for rank in range(2)]  # rank 0 creates
    reader = open_channel(plan, spec, member=2)
    full = {s.name: torch.full(s.shape, float(i)) for i, s in enumerate(SYNC_SPECS)}
    for bucket in range(len(plan.buckets)):
        for rank, writer in enumerate(writers):
            rows = {
                s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, 2))] for s in SYNC_SPECS
            }
            writer.write(bucket, rows)
        for name, tensor in reader.read(bucket):
            assert torch.equal(tensor, full[name])
