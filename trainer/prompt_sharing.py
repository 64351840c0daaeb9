"""The shared-prompt layout (`trainer.share_prompts`): a micro-batch's rows that begin with the
same prompt computed as one row, the prompt once and then each row's response.

GRPO samples `group_size` responses per prompt, and the padded layout runs the prompt's
forward and backward once per response. Here each response attends to the one copy of the
prompt and to its own earlier tokens only, with positions continuing from the prompt's end, so
every token sees exactly the context it has in its own row: the log-probs are the padded ones
and the gradient of the prompt's positions is the sum over the responses that read them.

A row's prompt is everything before its first trained target (`loss_mask`); rows share it when
those tokens are equal, so the split decides only what is shared, never the result. A row with
no trained target is a prompt of its own. The cost: attention over a row spans its prompt and
all its responses (a boolean [C, C] mask), so this pays where the prompt is long against the
responses, or the responses are short.
"""

from __future__ import annotations

import torch

from rl.expert_routing import NATURAL
from rl.types import Batch
from trainer.packing import ModelInput


def prompt_groups(micro: Batch) -> list[tuple[int, list[int]]]:
    """(prompt length, rows) for each distinct prompt of `micro`, in order of first row."""
    lengths = micro.attention_mask.sum(dim=1).tolist()
    ids, trained = micro.input_ids.tolist(), micro.loss_mask.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, length in enumerate(lengths):
        first_target = next((t for t, weight in enumerate(trained[row]) if weight), None)
        # Target t scores token t + 1: the response starts at the first trained target + 1.
        prompt_length = length if first_target is None else first_target + 1
        groups.setdefault(tuple(ids[row][:prompt_length]), []).append(row)
    return [(len(key), rows) for key, rows in groups.items()]


def shared_prompt_input(micro: Batch) -> ModelInput:
    """`micro` with one row per distinct prompt: [prompt, response 1, response 2, ...], padded
    to the longest such row. Targets are listed once where rows share them (the prompt's own)
    and per row from the prompt's last token on; `unpack` returns the padded [B, T-1].

    Built in Python lists, then made tensors once: per-row tensor ops are a visible share of a
    tiny model's train step."""
    lengths = micro.attention_mask.sum(dim=1).tolist()
    ids = micro.input_ids.tolist()
    groups = prompt_groups(micro)
    width = max(prompt + sum(lengths[r] - prompt for r in rows) for prompt, rows in groups)
    # Per row: its tokens, positions and each position's segment (0 the prompt, i the i-th
    # response, -1 padding).
    input_ids, position_ids, segments = [], [], []
    hidden_index, targets = [], []
    # Per position of the layout, the (row, position) of `micro` it holds: where its routing
    # record comes from (a shared prompt's from the first row that holds it).
    sources: list[tuple[int, int]] = []
    num_steps = micro.input_ids.shape[1] - 1
    unpack_index = [[-1] * num_steps for _ in range(micro.num_sequences)]
    for row, (prompt, rows) in enumerate(groups):
        tokens = ids[rows[0]]
        row_ids, row_positions, row_segments = tokens[:prompt], list(range(prompt)), [0] * prompt
        row_sources = [(rows[0], position) for position in range(prompt)]
        row_start = row * width
        # The prompt scores its own next tokens once for every row that shares it.
        shared = range(len(targets), len(targets) + prompt - 1)
        hidden_index += range(row_start, row_start + prompt - 1)
        targets += tokens[1:prompt]
        for segment, sample in enumerate(rows, start=1):
            response = ids[sample][prompt : lengths[sample]]
            offset = len(row_ids)
            # From the prompt's last token on, each target is this row's own: the position
            # before each response token, which for the first is the prompt's last.
            before = [prompt - 1, *range(offset, offset + len(response) - 1)][: len(response)]
            hidden_index += [row_start + position for position in before]
            unpack_index[sample][: prompt - 1] = shared
            unpack_index[sample][prompt - 1 : lengths[sample] - 1] = range(
                len(targets), len(targets) + len(response)
            )
            targets += response
            row_ids += response
            row_positions += range(prompt, lengths[sample])
            row_segments += [segment] * len(response)
            row_sources += [(sample, position) for position in range(prompt, lengths[sample])]
        padding = width - len(row_ids)
        sources += row_sources + [(-1, -1)] * padding
        input_ids.append(row_ids + [0] * padding)
        position_ids.append(row_positions + [0] * padding)
        segments.append(row_segments + [-1] * padding)
    unpack = torch.tensor(unpack_index, dtype=torch.long)
    unpack[unpack < 0] = len(targets)  # `unpack`'s zero for padding
    return ModelInput(
        torch.tensor(input_ids, dtype=micro.input_ids.dtype),
        _attention_mask(torch.tensor(segments, dtype=torch.long)),
        torch.tensor(position_ids, dtype=torch.long),
        torch.tensor(targets, dtype=micro.input_ids.dtype).reshape(-1),
        unpack,
        torch.tensor(hidden_index, dtype=torch.long).reshape(-1),
        routing=_routing(micro, sources, len(groups), width),
        real=torch.tensor([row >= 0 for row, _ in sources]).reshape(len(groups), width),
    )


def _routing(
    micro: Batch, sources: list[tuple[int, int]], num_rows: int, width: int
) -> torch.Tensor | None:
    """`micro.routing` in the layout: [num_rows, width, layers, k], each position's row taken
    from the (row, position) of `micro` in `sources` (-1, -1: padding, routed naturally)."""
    if micro.routing is None:
        return None
    rows, positions = torch.tensor(sources, dtype=torch.long).unbind(dim=1)
    padding = rows < 0
    out = micro.routing[rows.clamp(min=0), positions.clamp(min=0)]
    out[padding] = NATURAL
    return out.reshape(num_rows, width, *micro.routing.shape[2:])


def _attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[R, 1, C, C] boolean, True where query q may attend to key k: causal, and k in the
    prompt or in q's own response. Every position also sees itself, so that no query of the
    padding is left without a key: SDPA would return NaN there, and the backward pass would
    spread it.
    """
    query, key = segments[:, :, None], segments[:, None, :]
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (key >= 0) & ((key == 0) | (key == query))
    return (allowed | torch.eye(width, dtype=torch.bool))[:, None]
