"""Point-to-point weight pieces: each rollout rank receives exactly its regions' bytes."""

from __future__ import annotations

import pytest
import torch

from rl.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rl.weight_pieces import pack_piece, piece_numel, region_buffer, unpack_pieces
from rl.weight_plan import AttentionShape, Region, TensorSpec, owned_rows, plan_weight_sync
from tests.conftest import SYNC_SHAPE, SYNC_SPECS


@pytest.mark.parametrize(("world_size", "tp_size"), [(1, 1), (2, 1), (3, 2), (2, 4)])
def test_unpacked_regions_equal_the_full_tensors(world_size: int, tp_size: int) -> None:
    shape = AttentionShape(8, 4, 16, 1000) if tp_size == 4 else SYNC_SHAPE
    plan = plan_weight_sync(SYNC_SPECS, shape, world_size, tp_size, bucket_bytes=100_000)
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SYNC_SPECS)
    }
    for bucket in range(len(plan.buckets)):
        for tp_rank in range(tp_size):
            pieces = []
            for rank in range(world_size):
                shards = {
                    s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, world_size))]
                    for s in plan.buckets[bucket]
                }
                pieces.append(pack_piece(plan, bucket, rank, tp_rank, shards))
                assert pieces[-1].numel() == piece_numel(plan, bucket, rank, tp_rank)
            # Exactly the region's bytes travel to this rank, from all trainer ranks together.
            sent = sum(p.numel() for p in pieces)
            assert sent == sum(plan.region(s, tp_rank).numel for s in plan.buckets[bucket])
            for name, tensor in unpack_pieces(plan, bucket, tp_rank, pieces):
                spec = next(s for s in SYNC_SPECS if s.name == name)
                r = plan.region(spec, tp_rank)
                got = tensor.reshape(spec.num_rows, -1) if tensor.is_contiguous() else tensor
                want = full[name].reshape(spec.num_rows, -1)
                assert tensor.shape == spec.shape
                assert torch.equal(
                    got[r.row_start : r.row_stop, r.col_start : r.col_stop],
                    want[r.row_start : r.row_stop, r.col_start : r.col_stop],
                ), name


@pytest.mark.parametrize("columns", [False, True])
def test_a_region_buffer_makes_only_its_region_resident(columns: bool) -> None:
    spec = TensorSpec("model.layers.0.mlp.down_proj.weight", (4096, 4096))  # 64 MiB
    region = Region(0, 4096, 0, 512) if columns else Region(0, 512, 0, 4096)  # 8 MiB
    reset_peak_rss()
    base = rss_bytes()
    buffer = region_buffer(spec, region)
    buffer[region.row_start : region.row_stop, region.col_start : region.col_stop].fill_(1.0)
    grown = peak_rss_bytes() - base
    assert buffer.shape == spec.shape
    assert 7 << 20 < grown < 16 << 20, grown
