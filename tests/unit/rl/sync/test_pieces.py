"""Point-to-point weight pieces: each rollout rank receives exactly its regions' bytes."""

from __future__ import annotations

import pytest
import torch

from rl.sync.pieces import max_piece_numel, pack_piece, piece_numel, unpack_pieces
from rl.sync.plan import AttentionShape, owned_rows, plan_weight_sync
from tests.helpers.sync_specs import SYNC_SHAPE, SYNC_SPECS


@pytest.mark.parametrize(
    ("world_size", "tp_size", "wire"),
    [
        (1, 1, "float32"),
        (2, 1, "float32"),
        (3, 2, "float32"),
        (2, 4, "float32"),
        (3, 2, "bfloat16"),
    ],
)
def test_unpacked_regions_equal_the_full_tensors_in_the_wire_dtype(
    world_size: int, tp_size: int, wire: str
) -> None:
    shape = AttentionShape(8, 4, 16, 1000) if tp_size == 4 else SYNC_SHAPE
    plan = plan_weight_sync(
        SYNC_SPECS, shape, world_size, tp_size, bucket_bytes=100_000, wire_dtype=wire
    )
    dtype = getattr(torch, wire)
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SYNC_SPECS)
    }
    # Buffers made once and reused for every bucket, as the transport does.
    packed = {
        (rank, t): torch.empty(max_piece_numel(plan, rank, t), dtype=dtype)
        for rank in range(world_size)
        for t in range(tp_size)
    }
    flat = torch.full((plan.slot_numel,), float("nan"), dtype=dtype)
    for bucket in range(len(plan.buckets)):
        for tp_rank in range(tp_size):
            pieces = []
            for rank in range(world_size):
                shards = {
                    s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, world_size))]
                    for s in plan.buckets[bucket]
                }
                out = packed[rank, tp_rank]
                pieces.append(pack_piece(plan, bucket, rank, tp_rank, shards, out).clone())
                assert pieces[-1].numel() == piece_numel(plan, bucket, rank, tp_rank)
            # Exactly the region's bytes travel to this rank, from all trainer ranks together.
            sent = sum(p.numel() for p in pieces)
            assert sent == sum(plan.region(s, tp_rank).numel for s in plan.buckets[bucket])
            for name, tensor in unpack_pieces(plan, bucket, tp_rank, pieces, flat):
                spec = next(s for s in SYNC_SPECS if s.name == name)
                r = plan.region(spec, tp_rank)
                got = tensor.reshape(spec.num_rows, -1)
                want = full[name].to(dtype).reshape(spec.num_rows, -1)
                assert tensor.shape == spec.shape
                assert torch.equal(
                    got[r.row_start : r.row_stop, r.col_start : r.col_stop],
                    want[r.row_start : r.row_stop, r.col_start : r.col_stop],
                ), name
