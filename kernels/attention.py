"""The attention every Tandem model runs: SDPA, except for short bf16 attention on CPU; and
the trainer's attention over packed rows, sample by sample without a mask.

PyTorch's CPU flash-attention kernel is slow in half precision on short sequences: there an
explicit softmax(QK^T)V is several times faster, and from a few hundred tokens on the flash
kernel's tiling wins (bench/attention.py measures where; docs/benchmarks.md). Tiny models on
CPU live at those lengths, in training and in decoding, so `attention` computes the explicit
product there and calls SDPA everywhere else (fp32, GPUs, long keys). It is registered with
transformers as `ATTENTION`, with SDPA's boolean masks (decoding's left padding).

The trainer's rows are right-padded (causal attention never reads the padding: it comes
last) or packed, samples end to end (`trainer.packing`). Transformers would give a packed row
a [width, width] mask, rows x width^2 bytes that do not shrink with sequence parallelism
(16 GiB for one 128K-token row). `packed_attention` (`PACKED_ATTENTION`, registered without a
mask function, so transformers builds none) instead runs causal attention within each of the
row's `Segments`, which the packing knows on the host: on GPUs in half precision, PyTorch's
variable-length flash attention over the flattened rows; elsewhere `attention` over the
samples gathered into padded batches of similar lengths, a causal call each, the rows' tails
left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "tandem"  # the `attn_implementation` to load models with
# The `attn_implementation` of trained models whose every layer attends over the whole
# sequence (`packed_attention`; sliding-window layers keep `ATTENTION`'s masks).
PACKED_ATTENTION = "tandem_packed"
# The key length up to which the explicit product beats the flash kernel (bench/attention.py).
MAX_EXPLICIT_KEYS = 192


def uses_explicit_product(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `attention` computes softmax(QK^T)V itself for these [B, H, T, D] inputs."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    return query.device.type == "cpu" and half and key.shape[2] <= MAX_EXPLICIT_KEYS


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, Tq, D], key/value [B, Hkv, Tk, D],
    `attention_mask` SDPA's boolean [B, 1, Tq, Tk] (True: attend) or None (causal, queries
    aligned to the last keys) -> ([B, Tq, H, D], None)."""
    if not uses_explicit_product(query, key):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    return explicit_product(query, key, value, attention_mask, scale, dropout), None


def explicit_product(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(QK^T * scaling)V with the [B, H, Tq, Tk] scores in memory, as `attention` takes
    its inputs -> [B, Tq, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:
        num_queries, num_keys = query.shape[2], key.shape[2]
        positions = torch.arange(num_keys, device=query.device)
        attention_mask = positions[None, :] <= positions[-num_queries:, None]
    # The dtype's minimum, not -inf: a query that sees no key (left padding while prefilling)
    # gets a uniform row instead of NaN, which padding never reads.
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def attention_layer_types(config: object) -> set[str]:
    """The kinds of attention layer an HF config's model has (a config without `layer_types`
    attends over the whole sequence in every layer): `PACKED_ATTENTION` runs
    {"full_attention"} only."""
    return set(getattr(config, "layer_types", None) or ["full_attention"])


# Samples gathered into one padded batch are at least this share of its longest: the padding
# costs each sample at most (1 / share)^2 of its own attention.
_BUCKET_SHARE = 0.75


@dataclass(frozen=True)
class Segments:
    """The samples packed rows of equal width hold, end to end from each row's start, and each
    row's tail (the positions after its last sample, which score nothing). Host built
    (`of_rows`), so that attention reads nothing from the device to find them."""

    # [runs + 1] int32: where each run starts in the flattened rows [R * W] (every sample, and
    # every tail as a run of its own), and their end; `longest` the longest run.
    starts: torch.Tensor
    longest: int
    # Samples of similar lengths gathered into padded batches: per batch, [n, L] the flat
    # position of each of its samples' positions, L its longest, a shorter one padded with its
    # last position (causal attention never reads it: it comes last).
    gathers: tuple[torch.Tensor, ...]
    # [R * W]: each flat position's place in the batches' [n * L] positions, concatenated; a
    # tail's, one past their end. None, and no gathers, where every row holds one sample:
    # causal attention over the rows keeps it to itself (its tail, after it, reads it).
    scatter: torch.Tensor | None

    @classmethod
    def of_rows(cls, rows: list[list[int]], width: int) -> Segments:
        """Rows `width` wide, each the sample lengths it holds, in order."""
        assert all(row and min(row) > 0 and sum(row) <= width for row in rows)
        runs, samples = [], []  # samples: (length, first flat position)
        for i, row in enumerate(rows):
            start = i * width
            for length in row:
                samples.append((length, start))
                start += length
            tail = width - sum(row)
            runs += [*row, tail] if tail else row
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(runs).cumsum(0)])
        if len(samples) == len(rows):
            return cls(starts.int(), max(runs), (), None)
        scatter = torch.full((len(rows) * width,), -1)
        gathers, place = [], 0
        ordered = sorted(samples, reverse=True)
        while ordered:
            longest = ordered[0][0]
            batch = [s for s in ordered if s[0] >= _BUCKET_SHARE * longest]
            ordered = ordered[len(batch) :]
            lengths, firsts = (torch.tensor(x) for x in zip(*batch, strict=True))
            steps = torch.arange(longest)
            gathers.append(firsts[:, None] + steps.minimum(lengths[:, None] - 1))
            for k, (length, first) in enumerate(batch):
                scatter[first : first + length] = place + k * longest + steps[:length]
            place += len(batch) * longest
        scatter[scatter < 0] = place
        return cls(starts.int(), max(runs), tuple(gathers), scatter)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    segments: Segments | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """`attention`'s signature; with `segments` (packed rows: `attention_mask` None), causal
    attention within each sample of the [B, H, W, D] rows -> ([B, W, H, D], None). Without,
    or with one sample a row, `attention` as given: causal rows (right-padded or one sample
    each) or a 4D mask (shared prompts)."""
    if segments is None or segments.scatter is None:
        return attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    assert attention_mask is None, "packed rows attend within their segments, unmasked"
    rows, heads, width, dim = query.shape

    def flat(states: torch.Tensor) -> torch.Tensor:  # [B, h, W, D] -> [B * W, h, D]
        return states.transpose(1, 2).reshape(rows * width, states.shape[1], dim)

    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        starts, longest = segments.starts, segments.longest
        out = varlen_attn(
            flat(query), flat(key), flat(value), starts, starts, longest, longest,
            scale=scaling, window_size=(-1, 0), enable_gqa=True,
        )  # fmt: skip
        return out.view(rows, width, heads, dim), None

    query, key, value = flat(query), flat(key), flat(value)
    outs = []
    for gather in segments.gathers:

        def batched(states: torch.Tensor, gather: torch.Tensor = gather) -> torch.Tensor:
            picked = states.index_select(0, gather.flatten())  # -> [n, h, L, D]
            return picked.unflatten(0, gather.shape).transpose(1, 2)

        out, _ = attention(
            module, batched(query), batched(key), batched(value), None, dropout, scaling, True
        )
        outs.append(out.flatten(0, 1))
    # The tails attend to nothing: 0, which no target reads (and no gradient reaches).
    out = torch.cat([*outs, query.new_zeros(1, heads, dim)])
    return out.index_select(0, segments.scatter).view(rows, width, heads, dim), None


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
AttentionInterface.register(PACKED_ATTENTION, packed_attention)
