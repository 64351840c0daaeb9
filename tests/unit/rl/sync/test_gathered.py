"""The gathered transport's layout: each trainer rank's rows packed into a piece of the same
width, and the all-gathered pieces laid out as whole tensors in a slot, in the wire dtype."""

from __future__ import annotations

import pytest
import torch

from rl.sync.gathered import pack_rows, piece_numel, place_pieces
from rl.sync.pieces import bucket_tensors
from rl.sync.plan import owned_rows, plan_weight_sync
from tests.helpers.sync_specs import SYNC_SHAPE, SYNC_SPECS


@pytest.mark.parametrize(("world_size", "wire"), [(1, "float32"), (3, "float32"), (2, "bfloat16")])
def test_gathered_pieces_lay_out_every_tensor_whole_in_the_wire_dtype(
    world_size: int, wire: str
) -> None:
    plan = plan_weight_sync(
        SYNC_SPECS, SYNC_SHAPE, world_size, 2, bucket_bytes=50_000, wire_dtype=wire
    )
    dtype = getattr(torch, wire)
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SYNC_SPECS)
    }
    width = piece_numel(plan)
    slot = torch.full((plan.slot_numel,), float("nan"), dtype=dtype)
    for bucket in range(len(plan.buckets)):
        # What all_gather_single leaves on every rank: rank w's piece in row w.
        pieces = torch.full((world_size, width), float("nan"), dtype=dtype)
        for rank in range(world_size):
            rows = {
                s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, world_size))]
                for s in plan.buckets[bucket]
            }
            pack_rows(plan, bucket, rows, rank, pieces[rank])
        place_pieces(plan, bucket, pieces, slot)
        for name, tensor in bucket_tensors(slot, plan, bucket):
            # Rounded as an engine of that dtype rounds fp32 weights when it loads them.
            assert torch.equal(tensor, full[name].to(dtype)), name
    # The widest piece is the most one rank holds of one bucket: uneven rows pad the others.
    assert width == max(
        sum(
            (stop - start) * s.num_cols
            for s in plan.buckets[b]
            for start, stop in [owned_rows(s.num_rows, rank, world_size)]
        )
        for b in range(len(plan.buckets))
        for rank in range(world_size)
    )
