"""Ulysses sequence parallelism (DeepSpeed-Ulysses): a group of N trainer ranks runs every
packed row together, each rank holding 1/N of the row's positions (contiguous chunks, rows
packed as wide as a multiple of N).

The decoder runs on the rank's positions. Attention needs every position of a row: around it
an all-to-all exchanges positions for heads (each rank then holds the whole row for H/N of the
heads; GQA's key/value heads are repeated first where there are fewer than N, so that each
rank gets whole heads), and a second all-to-all exchanges them back. Rotary embeddings come
from the positions the rank holds; attention over the whole rows keeps to their samples as
without sequence parallelism (`kernels.attention.packed_attention`, no mask: the rows'
`Segments`).

The fused log-prob kernel scores the rank's positions; the per-token results are all-gathered
into the micro-batch's [B, T-1] layout, where every rank of the group computes the same loss
(an aggregation may need whole sequences: seq-mean-token-mean, GSPO's sequence ratio). The
gather's backward hands each rank its own slice of the gradient, so the group's gradients sum
to the one loss's, and FSDP2's reduce over every rank (parameters are sharded over dp x sp)
adds them up as it adds up the data-parallel ranks'.

The groups are `size` consecutive ranks: the (dp, sp) mesh `join`. Every rank of a group runs
the same micro-batches (`trainer.ranks.micro_batches` deals rows to the data-parallel index).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from kernels.attention import Segments, attention_layer_types, packed_attention
from rl.expert_routing import RouterCall
from trainer.packing import IGNORE, ModelInput

SP_ATTENTION = "tandem_ulysses"  # the `attn_implementation` of a model run sequence-parallel


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: `size` consecutive ranks (`group`)
    that run the same micro-batches, this one holding chunk `rank` of every row."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @property
    def counts_rows(self) -> bool:
        """Whether this rank reports the group's per-row results and metrics (the first does:
        the others hold the same)."""
        return self.rank == 0


def join(device_type: str, world_size: int, size: int) -> SequenceParallel | None:
    """This rank's group of the (dp, sp) mesh over `world_size` ranks (a collective: every
    rank builds it); None for `size` 1."""
    if size == 1:
        return None
    assert world_size % size == 0, "checked by rl.config.checks"
    mesh = init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=("dp", "sp"))
    return SequenceParallel(mesh["sp"].get_group(), mesh["sp"].get_local_rank(), size)


def kv_repeats(num_kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that `size` ranks get whole heads:
    the repeated count, lcm(num_kv_heads, size), divides the query heads wherever `size` does
    (they are a multiple of both)."""
    return size // math.gcd(num_kv_heads, size)


def prepare_model(model: nn.Module, size: int, source: str) -> None:
    """Switch `model`'s attention to the sequence-parallel one (`ulysses_attention`);
    ValueError, naming `source` (the checkpoint), when it cannot run with `size` ranks."""
    config = model.config
    heads = config.num_attention_heads
    if heads % size:
        raise ValueError(
            f"trainer.sequence_parallel={size} gives each rank 1/{size} of the attention heads, "
            f"but {source} has num_attention_heads={heads}: choose a degree that divides it"
        )
    layer_types = attention_layer_types(config)
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"trainer.sequence_parallel={size}: {source} has {sorted(layer_types)} attention "
            "layers; sequence parallelism runs full-attention models only (set it to 1)"
        )
    model.set_attn_implementation(SP_ATTENTION)


@dataclass
class SequenceShard:
    """One rank's part of a packed micro-batch (`shard_input`): [R, W/N] of its rows, W
    positions wide, and the whole rows' segments."""

    input_ids: Tensor
    position_ids: Tensor
    # The token each position scores (position t: the row's token t + 1); IGNORE where a
    # position scores nothing (a row's tail, its last position).
    targets: Tensor
    segments: Segments


def padded_width(width: int, size: int) -> int:
    """A row of `width` positions padded to a multiple of `size`."""
    return -(-width // size) * size


def chunk_of(rows: Tensor, rank: int, size: int) -> Tensor:
    """Chunk `rank` of `size` of every row of `rows` [R, W, ...]: its positions W/N wide."""
    chunk = rows.shape[1] // size
    return rows[:, rank * chunk : (rank + 1) * chunk]


def shard_input(inputs: ModelInput, rank: int, size: int) -> SequenceShard:
    """Chunk `rank` of `size` of every packed row of `inputs` (`trainer.packing.packed_input`,
    rows `padded_width` wide: `trainer.ranks.micro_batches` packs them so). Targets are the
    row's [R, W-1] with IGNORE appended for the last position."""
    assert inputs.segments is not None and inputs.hidden_index is None, "packed rows only"
    width = inputs.input_ids.shape[1]
    assert width % size == 0, "rows packed to a multiple of the group's size"
    targets = nn.functional.pad(inputs.targets, (0, 1), value=IGNORE)
    ids, positions, targets = (
        chunk_of(x, rank, size) for x in (inputs.input_ids, inputs.position_ids, targets)
    )
    return SequenceShard(ids, positions, targets, inputs.segments)


def merge_slices(values: Tensor, inputs: ModelInput) -> Tensor:
    """Per-position values of the rows [R, W] (every rank's slice, in rank order) -> the
    micro-batch's [B, T-1] (`ModelInput.unpack`)."""
    return inputs.unpack(values[:, : inputs.targets.shape[1]])


# What a model computes from the decoder's outputs at the positions that score a target: the
# outputs [..., d] and the targets [...] (IGNORE where a position scores nothing) -> values of
# the targets' shape (log-probs and entropy; a critic's values).
PerTarget = Callable[[Tensor, Tensor], tuple[Tensor, ...]]


def run_decoder(
    decoder: nn.Module, inputs: ModelInput, sp: SequenceParallel | None, per_target: PerTarget
) -> tuple[Tensor, ...]:
    """`per_target` of `decoder`'s outputs over the micro-batch `inputs` was built from, each
    value [B, T-1] of its padded layout. With `sp`, the decoder and `per_target` run on this
    rank's chunk of every packed row, and every rank of the group gets the whole micro-batch's
    values (`gather_positions`: the backward keeps this rank's slice of the gradient)."""
    if sp is None:
        hidden = decoder(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
            segments=inputs.segments,  # packed rows: to `kernels.attention.packed_attention`
        ).last_hidden_state
        values = per_target(inputs.target_hidden(hidden), inputs.targets)
        return tuple(inputs.unpack(value) for value in values)
    shard = shard_input(inputs, sp.rank, sp.size)
    hidden = decoder(
        input_ids=shard.input_ids,
        position_ids=shard.position_ids,
        use_cache=False,
        segments=shard.segments,  # to `ulysses_attention`, with:
        sequence_parallel=sp,
    ).last_hidden_state
    values = per_target(hidden, shard.targets)
    return tuple(merge_slices(gather_positions(value, sp), inputs) for value in values)


# Layouts around the all-to-all, which sends chunk j of dimension 0 to rank j and receives
# rank j's chunk for this rank as chunk j.


def heads_to_send(states: Tensor, size: int) -> Tensor:
    """[B, H, L, D] of this rank's positions -> [N, B, H/N, L, D]: chunk j, heads j*H/N..."""
    return states.unflatten(1, (size, -1)).movedim(1, 0).contiguous()


def row_from_received(received: Tensor) -> Tensor:
    """[N, B, h, L, D] (chunk j: rank j's positions of this rank's heads) -> [B, h, N*L, D]."""
    return received.movedim(0, 2).flatten(2, 3)


def positions_to_send(states: Tensor, size: int) -> Tensor:
    """[B, N*L, h, D] of this rank's heads -> [N, B, L, h, D]: chunk j, rank j's positions."""
    return states.unflatten(1, (size, -1)).movedim(1, 0).contiguous()


def heads_from_received(received: Tensor) -> Tensor:
    """[N, B, L, h, D] (chunk j: rank j's heads of this rank's positions) -> [B, L, N*h, D]."""
    return received.movedim(0, 2).flatten(2, 3)


def _all_to_all(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The all-to-all of dimension 0 (its size the group's). Chunk j of rank r goes to chunk r
    of rank j: the exchange is its own inverse, so its backward is the same exchange."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_to_all(grad.contiguous(), ctx.group), None


class _GatherPositions(torch.autograd.Function):
    """[R, L, ...] per rank -> [R, N*L, ...], the ranks' slices in rank order. Every rank of the group
    computes the same loss of the gathered values, so each one's gradient is its own slice's."""

    @staticmethod
    def forward(ctx, values: Tensor, sp: SequenceParallel) -> Tensor:
        ctx.rank, ctx.chunk = sp.rank, values.shape[1]
        parts = [torch.empty_like(values) for _ in range(sp.size)]
        dist.all_gather(parts, values.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad[:, ctx.rank * ctx.chunk : (ctx.rank + 1) * ctx.chunk], None


def gather_positions(values: Tensor, sp: SequenceParallel) -> Tensor:
    """This rank's per-position values [R, W/N, ...] -> the rows' [R, W, ...] on every rank
    of the group; differentiable (see `_GatherPositions`)."""
    return _GatherPositions.apply(values, sp)


def gather_router_calls(calls: list[RouterCall], rows: int, sp: SequenceParallel) -> list:
    """A mixture of experts' router calls over this rank's positions of `rows` packed rows
    (each [rows x W/N, ...], row-major) -> the calls over the whole rows, on every rank of the
    group: the router losses and statistics see the micro-batch as without sequence
    parallelism, and the logits' gradient reaches each rank's own positions."""

    def whole(values: Tensor) -> Tensor:
        return gather_positions(values.unflatten(0, (rows, -1)), sp).flatten(0, 1)

    return [RouterCall(whole(c.logits), whole(c.natural), whole(c.used)) for c in calls]


class _HeadShare:
    """An attention module as transformers' attention functions read it, with the key/value
    groups of the heads this rank holds (the module's own count is the whole model's)."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module, self.num_key_value_groups = module, num_key_value_groups

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


def ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    sequence_parallel: SequenceParallel,
    segments: Segments,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """transformers' attention signature over this rank's positions: query [B, H, L, D],
    key/value [B, Hkv, L, D], no mask (`segments`: the whole rows') -> ([B, L, H, D], None).
    Runs `kernels.attention.packed_attention` on the whole rows of H/N heads between two
    all-to-alls."""
    sp = sequence_parallel
    repeats = kv_repeats(key.shape[1], sp.size)
    key, value = repeat_kv(key, repeats), repeat_kv(value, repeats)
    query, key, value = (
        row_from_received(_AllToAll.apply(heads_to_send(states, sp.size), sp.group))
        for states in (query, key, value)
    )
    share = _HeadShare(module, query.shape[1] // key.shape[1])
    out, _ = packed_attention(share, query, key, value, None, dropout, scaling, segments=segments)
    sent = _AllToAll.apply(positions_to_send(out, sp.size), sp.group)
    return heads_from_received(sent), None


AttentionInterface.register(SP_ATTENTION, ulysses_attention)
