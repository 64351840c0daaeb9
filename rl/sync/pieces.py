"""Point-to-point weight pieces, for transports where ranks do not share memory (across hosts):
each trainer rank sends each rollout TP rank one flat buffer per bucket holding exactly the
bytes of that rank's regions it owns; the receiver places them into full-shaped tensors laid
out as in a shared-memory slot. Plain tensor code (no torch.distributed, no vLLM)."""

from __future__ import annotations

import torch

from rl.sync.plan import Region, TensorSpec, WeightSyncPlan, owned_rows


def buffer_device() -> torch.device:
    """Where this process's weight-sync buffers live: its current GPU, so that the weights
    never leave the devices, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def max_piece_numel(plan: WeightSyncPlan, rank: int, tp_rank: int) -> int:
    """The largest piece trainer `rank` sends rollout rank `tp_rank`, over all buckets."""
    return max(piece_numel(plan, b, rank, tp_rank) for b in range(len(plan.buckets)))


def pack_piece(
    plan: WeightSyncPlan,
    bucket: int,
    rank: int,
    tp_rank: int,
    local_rows: dict[str, torch.Tensor],
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill the flat buffer `out` (the plan's wire dtype) with what trainer `rank` sends rollout
    rank `tp_rank`:
    for each tensor of `bucket` in order, the rows x columns of the rank's region it owns,
    row-major. Returns the filled front of `out`."""
    offset = 0
    for spec in plan.buckets[bucket]:
        box = _overlap(plan, spec, rank, tp_rank)
        if box.numel:
            start, _ = owned_rows(spec.num_rows, rank, plan.world_size)
            local = local_rows[spec.name].reshape(-1, spec.num_cols)
            rows = local[box.row_start - start : box.row_stop - start]
            target = out[offset : offset + box.numel].view(rows.shape[0], -1)
            target.copy_(rows[:, box.col_start : box.col_stop])
            offset += box.numel
    return out[:offset]


def bucket_tensors(
    flat: torch.Tensor, plan: WeightSyncPlan, bucket: int
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `bucket` as full-shaped views of `flat`, laid out whole one after
    another (`plan.offsets`); no copy."""
    return [
        (spec.name, flat[offset : offset + spec.num_rows * spec.num_cols].view(spec.shape))
        for spec, offset in zip(plan.buckets[bucket], plan.offsets(bucket), strict=True)
    ]


def unpack_pieces(
    plan: WeightSyncPlan,
    bucket: int,
    tp_rank: int,
    pieces: list[torch.Tensor],
    flat: torch.Tensor,
) -> list[tuple[str, torch.Tensor]]:
    """Place `pieces[rank]` (what each trainer rank sent rollout rank `tp_rank`) into `flat`
    (at least `plan.slot_numel` elements); returns `bucket`'s tensors as full-shaped views
    of it, of which only this rank's regions hold data (the loaders read nothing else)."""
    offsets = [0] * plan.world_size
    views = bucket_tensors(flat, plan, bucket)
    for spec, (_, view) in zip(plan.buckets[bucket], views, strict=True):
        full = view.reshape(spec.num_rows, spec.num_cols)
        for rank, piece in enumerate(pieces):
            box = _overlap(plan, spec, rank, tp_rank)
            if box.numel:
                block = piece[offsets[rank] : offsets[rank] + box.numel]
                full[box.row_start : box.row_stop, box.col_start : box.col_stop].copy_(
                    block.view(box.row_stop - box.row_start, -1)
                )
                offsets[rank] += box.numel
    assert offsets == [piece.numel() for piece in pieces], (offsets, [p.numel() for p in pieces])
    return views
