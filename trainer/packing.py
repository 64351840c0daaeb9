"""The decoder's input for one micro-batch: the padded rows as they are, or the samples packed.

Packing lays the micro-batch's samples end to end in a few rows (first fit, longest first, in
rows as wide as the mini-batch's longest sample), with positions restarting at 0 for every
sample and no attention mask: the rows' `Segments` (each sample, and a row's tail) keep each
token's attention inside its own sample (`kernels.attention.packed_attention`; a model with
sliding-window layers reads the boundaries from the positions instead, transformers'
`find_packed_sequence_indices`). No position is spent on padding but the ends of rows, and a
row's attention costs no more than a padded row's, since no row is wider than the padded
layout.

Either way the outputs come back in the padded [B, T-1] layout of the micro-batch (`unpack`),
where the losses are computed: per-token results are the same whichever layout was run. A
third layout, rows that share a prompt computed as one, is `trainer.prompt_sharing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import Segments
from rl.expert_routing import NATURAL
from rl.types import Batch
from trainer.micro_batching import pack_rows

IGNORE = -100  # target id of positions that score no token of their own sample


@dataclass
class ModelInput:
    """input_ids, position_ids [R, C]; attention_mask [R, C], a boolean [R, 1, C, C] (shared
    prompts) or None (packed); targets [R, C-1], or [K] with hidden_index [K] (shared prompts:
    target k is scored from the decoder's output at flat position hidden_index[k] of the
    [R * C] positions); unpack_index [B, T-1] or None (padded: the layout already is [B, T-1])."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    targets: torch.Tensor
    unpack_index: torch.Tensor | None = None
    hidden_index: torch.Tensor | None = None
    # [R, C, MoE layers, k]: the experts each position routes to, -1 where the router chooses
    # (rl.types.Batch.routing in this layout); None: every position routes naturally.
    routing: torch.Tensor | None = None
    # [R, C] bool, True at the positions that hold a sample's token (not padding): what a
    # mixture of experts' router statistics count.
    real: torch.Tensor | None = None
    # Packed rows: the runs attention keeps to (each sample, each row's tail).
    segments: Segments | None = None

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's output [R, C, d] at the positions that score `targets`, in their
        shape: [R, C-1, d], or [K, d] with hidden_index."""
        if self.hidden_index is None:
            return hidden[:, :-1]
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.hidden_index)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-target values (the shape of `targets`) -> [B, T-1] per target of the padded
        micro-batch, 0 at padding. Differentiable (a gather)."""
        if self.unpack_index is None:
            return values
        flat = torch.cat([values.reshape(-1), values.new_zeros(1)])  # the last entry: padding
        return flat[self.unpack_index]


def padded_input(micro: Batch) -> ModelInput:
    """The micro-batch's own right-padded rows; padding targets are IGNORE."""
    targets = micro.input_ids[:, 1:].masked_fill(micro.attention_mask[:, 1:] == 0, IGNORE)
    return ModelInput(
        micro.input_ids,
        micro.attention_mask,
        None,
        targets,
        routing=micro.routing,
        real=micro.attention_mask.bool(),
    )


def packed_input(micro: Batch, width: int = 0) -> ModelInput:
    """The micro-batch's samples packed first-fit into rows of `width` positions (at least its
    longest sample's; 0: exactly that)."""
    lengths = micro.attention_mask.sum(dim=1).tolist()
    width = max(width, *lengths)
    layout = pack_rows(lengths, width)
    num_rows, num_steps = len(layout), micro.input_ids.shape[1] - 1
    input_ids = torch.zeros(num_rows, width, dtype=micro.input_ids.dtype)
    # The tail of a row counts on from 0 as a sample of its own: it scores nothing.
    position_ids = torch.zeros(num_rows, width, dtype=torch.long)
    targets = torch.full((num_rows, width - 1), IGNORE, dtype=micro.input_ids.dtype)
    padding = num_rows * (width - 1)  # the index `unpack` reads as 0
    unpack_index = torch.full((micro.num_sequences, num_steps), padding, dtype=torch.long)
    real = torch.zeros(num_rows, width, dtype=torch.bool)
    routing = None
    if micro.routing is not None:
        routing = micro.routing.new_full((num_rows, width, *micro.routing.shape[2:]), NATURAL)
    runs = []
    for row, samples in enumerate(layout):
        offset = 0
        runs.append([lengths[sample] for sample in samples])
        for sample in samples:
            n = lengths[sample]
            tokens = micro.input_ids[sample, :n]
            input_ids[row, offset : offset + n] = tokens
            position_ids[row, offset : offset + n] = torch.arange(n)
            # Position offset + t scores the sample's token t + 1; its last scores nothing.
            targets[row, offset : offset + n - 1] = tokens[1:]
            unpack_index[sample, : n - 1] = row * (width - 1) + offset + torch.arange(n - 1)
            if routing is not None:
                routing[row, offset : offset + n] = micro.routing[sample, :n]
            offset += n
        real[row, :offset] = True
        position_ids[row, offset:] = torch.arange(width - offset)
    return ModelInput(
        input_ids,
        None,
        position_ids,
        targets,
        unpack_index,
        routing=routing,
        real=real,
        segments=Segments.of_rows(runs, width),
    )
