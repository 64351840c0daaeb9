"""Samples -> padded training `Batch`."""

from __future__ import annotations

import dataclasses

import torch

from rl.expert_routing import NATURAL
from rl.types import Batch, Sample


def build_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-padded tensors for `samples`, advantages still zero.

    `old_logprobs` are the samples' recomputed proximal log-probs where the trainer side has
    filled them, else the behaviour log-probs; reference and teacher log-probs and values come
    along when every sample has them. Rows are built as lists and made tensors once: per-row tensor
    writes are slow, and this runs on the driver's critical path.
    """
    max_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    def padded(rows: list[list], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=dtype)

    def at_targets(values: list[list[float]]) -> torch.Tensor:
        """[B, T-1] fp32 with each sample's per-response-token `values` at its response's
        targets (`response_targets`), 0 elsewhere."""
        rows = []
        for sample, row_values in zip(samples, values, strict=True):
            assert len(row_values) == len(sample.response_ids), "not one value per response token"
            rows.append([0.0] * (len(sample.prompt_ids) - 1) + list(row_values))
        return padded(rows, max_len - 1, 0.0, torch.float32)

    def per_token(field: str) -> torch.Tensor | None:
        """`at_targets` of a per-response-token list field, or None if a sample lacks it."""
        if any(getattr(s, field) is None for s in samples):
            return None
        return at_targets([getattr(s, field) for s in samples])

    sequences = [s.prompt_ids + s.response_ids for s in samples]
    # Multi-turn samples train on their sampled tokens only (rl.types.Sample.sampled_mask).
    loss_mask = at_targets([list(map(float, s.sampled_mask)) for s in samples])
    behaviour = per_token("logprobs")
    old = per_token("old_logprobs")
    return Batch(
        input_ids=padded(sequences, max_len, pad_id, torch.long),
        attention_mask=padded([[1] * len(seq) for seq in sequences], max_len, 0, torch.long),
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        old_logprobs=behaviour.clone() if old is None else old,
        advantages=torch.zeros_like(loss_mask),
        ref_logprobs=per_token("ref_logprobs"),
        old_values=per_token("values"),
        teacher_logprobs=per_token("teacher_logprobs"),
        routing=routing_rows(samples, max_len),
    )


def routing_rows(samples: list[Sample], width: int) -> torch.Tensor | None:
    """[B, width, layers, k] int16: each sample's recorded experts at the positions it holds
    rows for, -1 elsewhere; None when no sample has a record (rl.types.Sample.routed_experts)."""
    records = [s.routed_experts for s in samples]
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(samples), width, *first.shape[1:]), NATURAL, dtype=torch.int16)
    for row, record in enumerate(records):
        if record is not None:
            out[row, : len(record)] = record.to(torch.int16)
    return out


def response_targets(sample: Sample) -> slice:
    """The target positions of `sample`'s response in a batch row: position t predicts token
    t+1, so the response occupies targets prompt_len-1 .. prompt_len+response_len-2."""
    prompt_len = len(sample.prompt_ids)
    return slice(prompt_len - 1, prompt_len + len(sample.response_ids) - 1)


def per_sample(values: torch.Tensor, samples: list[Sample]) -> list[list[float]]:
    """The response part of each row of `values` [B, T-1], as one list per sample."""
    return [values[row, response_targets(s)].tolist() for row, s in enumerate(samples)]


def with_segments(samples: list[Sample]) -> list[Sample]:
    """`samples`, then the earlier segments of their agent functions' episodes (each a sample
    of its own sequence, rl.agents.api_calls), in order: every sequence a step trains on."""
    return samples + [
        segment for s in samples if s.episode is not None for segment in s.episode.segments
    ]


def stack(first: Batch, second: Batch, pad_id: int) -> Batch:
    """The rows of `first`, then those of `second`, right-padded to the longer width (input
    ids with `pad_id`, routing with NATURAL, everything else with 0). A tensor only one of them
    has is dropped."""
    width = max(first.input_ids.shape[1], second.input_ids.shape[1])
    fills = {"input_ids": pad_id, "routing": NATURAL}
    fields = {}
    for f in dataclasses.fields(Batch):
        a, b = getattr(first, f.name), getattr(second, f.name)
        if a is None or b is None:
            fields[f.name] = None
            continue
        full = width if f.name in ("input_ids", "attention_mask", "routing") else width - 1
        # Dimension 1 is the position; F.pad lists dimensions from the last.
        fields[f.name] = torch.cat(
            [
                torch.nn.functional.pad(
                    t, (0, 0) * (t.dim() - 2) + (0, full - t.shape[1]), value=fills.get(f.name, 0)
                )
                for t in (a, b)
            ]
        )
    return Batch(**fields)
