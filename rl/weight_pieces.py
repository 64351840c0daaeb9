"""Point-to-point weight pieces, for transports where ranks do not share memory (across hosts):
each trainer rank sends each rollout TP rank one flat buffer per bucket holding exactly the
bytes of that rank's regions it owns; the receiver places them into full-shaped tensors.
Plain tensor code (no torch.distributed, no vLLM)."""

from __future__ import annotations

import torch

from rl.weight_plan import Region, TensorSpec, WeightSyncPlan, owned_rows


def _overlap(plan: WeightSyncPlan, spec: TensorSpec, rank: int, tp_rank: int) -> Region:
    """The part of `tp_rank`'s region of `spec` whose rows trainer `rank` owns."""
    region = plan.region(spec, tp_rank)
    start, stop = owned_rows(spec.num_rows, rank, plan.world_size)
    return Region(
        max(region.row_start, start),
        min(region.row_stop, stop),
        region.col_start,
        region.col_stop,
    )


def piece_numel(plan: WeightSyncPlan, bucket: int, rank: int, tp_rank: int) -> int:
    """Elements trainer `rank` sends rollout rank `tp_rank` for `bucket`."""
    return sum(_overlap(plan, spec, rank, tp_rank).numel for spec in plan.buckets[bucket])


def pack_piece(
    plan: WeightSyncPlan,
    bucket: int,
    rank: int,
    tp_rank: int,
    local_rows: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The flat fp32 buffer trainer `rank` sends rollout rank `tp_rank`: for each tensor of
    `bucket` in order, the rows x columns of the rank's region it owns, row-major."""
    parts = []
    for spec in plan.buckets[bucket]:
        box = _overlap(plan, spec, rank, tp_rank)
        if box.numel:
            start, _ = owned_rows(spec.num_rows, rank, plan.world_size)
            local = local_rows[spec.name].reshape(-1, spec.num_cols)
            rows = local[box.row_start - start : box.row_stop - start]
            parts.append(rows[:, box.col_start : box.col_stop].reshape(-1))
    if not parts:
        return torch.empty(0)
    return torch.cat(parts).to("cpu", torch.float32)


def region_buffer(spec: TensorSpec, region: Region) -> torch.Tensor:
    """A [rows, cols] tensor of `spec`'s size of which only `region` will be written.

    vLLM's loaders take full-shaped tensors and narrow them to their rank's part. Memory from
    `torch.empty` is only reserved until touched, so only the region's pages become resident.
    For a column region (row-parallel weights) the buffer is column-major, which makes the
    region contiguous too.
    """
    rows, cols = spec.num_rows, spec.num_cols
    if region.col_start == 0 and region.col_stop == cols:
        return torch.empty(rows, cols)
    return torch.empty(cols, rows).t()


def unpack_pieces(
    plan: WeightSyncPlan, bucket: int, tp_rank: int, pieces: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Full-shaped tensors of `bucket` for rollout rank `tp_rank` from `pieces[rank]` (what
    each trainer rank sent); only each tensor's region holds data."""
    offsets = [0] * plan.world_size
    out = []
    for spec in plan.buckets[bucket]:
        region = plan.region(spec, tp_rank)
        full = region_buffer(spec, region)
        for rank, piece in enumerate(pieces):
            box = _overlap(plan, spec, rank, tp_rank)
            if box.numel:
                block = piece[offsets[rank] : offsets[rank] + box.numel]
                full[box.row_start : box.row_stop, box.col_start : box.col_stop].copy_(
                    block.view(box.row_stop - box.row_start, box.col_stop - box.col_start)
                )
                offsets[rank] += box.numel
        # A column-major buffer only serves 2-D weights, whose shape it already has.
        out.append((spec.name, full.view(spec.shape) if full.is_contiguous() else full))
    assert offsets == [piece.numel() for piece in pieces], (offsets, [p.numel() for p in pieces])
    return out
