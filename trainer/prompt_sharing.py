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

from rl.types import Batch
from trainer.packing import ModelInput


def prompt_groups(micro: Batch) -> list[tuple[int, list[int]]]:
    """(prompt length, rows) for each distinct prompt of `micro`, in order of first row."""
    lengths = micro.attention_mask.sum(dim=1).tolist()
    trained = micro.loss_mask.bool()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, length in enumerate(lengths):
        targets = trained[row].nonzero()
        # Target t scores token t + 1: the response starts at the first trained target + 1.
        prompt_length = int(targets[0]) + 1 if len(targets) else length
        key = tuple(micro.input_ids[row, :prompt_length].tolist())
        groups.setdefault(key, []).append(row)
    return [(len(key), rows) for key, rows in groups.items()]


def shared_prompt_input(micro: Batch) -> ModelInput:
    """`micro` with one row per distinct prompt: [prompt, response 1, response 2, ...], padded
    to the longest such row. Targets are listed once where rows share them (the prompt's own)
    and per row from the prompt's last token on; `unpack` returns the padded [B, T-1]."""
    lengths = micro.attention_mask.sum(dim=1).tolist()
    groups = prompt_groups(micro)
    widths = [prompt + sum(lengths[r] - prompt for r in rows) for prompt, rows in groups]
    num_rows, width = len(groups), max(widths)
    input_ids = torch.zeros(num_rows, width, dtype=micro.input_ids.dtype)
    position_ids = torch.zeros(num_rows, width, dtype=torch.long)
    # Each position's segment: 0 the prompt, i the i-th response, -1 padding.
    segments = torch.full((num_rows, width), -1, dtype=torch.long)
    hidden_index, targets = [], []
    unpack_index = torch.full((micro.num_sequences, micro.input_ids.shape[1] - 1), -1)
    for row, (prompt, rows) in enumerate(groups):
        tokens = micro.input_ids[rows[0]]
        input_ids[row, :prompt], segments[row, :prompt] = tokens[:prompt], 0
        position_ids[row, :prompt] = torch.arange(prompt)
        row_start = row * width
        # The prompt scores its own next tokens once for every row that shares it.
        shared = torch.arange(len(targets), len(targets) + prompt - 1)
        hidden_index += range(row_start, row_start + prompt - 1)
        targets += tokens[1:prompt].tolist()
        offset = prompt
        for segment, sample in enumerate(rows, start=1):
            response = micro.input_ids[sample, prompt : lengths[sample]]
            end = offset + len(response)
            input_ids[row, offset:end], segments[row, offset:end] = response, segment
            position_ids[row, offset:end] = torch.arange(prompt, lengths[sample])
            # From the prompt's last token on, each target is this row's own: the position
            # before each response token, which for the first is the prompt's last.
            before = [prompt - 1, *range(offset, end - 1)][: len(response)]
            own = torch.arange(len(targets), len(targets) + len(response))
            hidden_index += [row_start + position for position in before]
            targets += response.tolist()
            unpack_index[sample, : prompt - 1] = shared
            unpack_index[sample, prompt - 1 : lengths[sample] - 1] = own
            offset = end
    unpack_index[unpack_index < 0] = len(targets)  # `unpack`'s zero for padding
    return ModelInput(
        input_ids,
        _attention_mask(segments),
        position_ids,
        torch.tensor(targets, dtype=micro.input_ids.dtype).reshape(-1),
        unpack_index,
        torch.tensor(hidden_index, dtype=torch.long).reshape(-1),
    )


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
