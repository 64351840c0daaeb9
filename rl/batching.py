"""Samples -> padded training `Batch`."""

from __future__ import annotations

import torch

from rl.types import Batch, Sample


def build_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-padded tensors for `samples`, advantages still zero.

    `old_logprobs` are the samples' recomputed proximal log-probs where the trainer side has
    filled them, else the behaviour log-probs; reference log-probs and values come along when
    every sample has them.
    """
    max_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    num = len(samples)
    input_ids = torch.full((num, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num, max_len), dtype=torch.long)

    def per_token(field: str) -> torch.Tensor | None:
        """[B, T-1] of a per-response-token list field, or None if a sample lacks it."""
        if any(getattr(s, field) is None for s in samples):
            return None
        out = torch.zeros((num, max_len - 1), dtype=torch.float32)
        for row, sample in enumerate(samples):
            out[row, response_targets(sample)] = torch.tensor(
                getattr(sample, field), dtype=torch.float32
            )
        return out

    loss_mask = torch.zeros((num, max_len - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        total = len(sample.prompt_ids) + len(sample.response_ids)
        input_ids[row, :total] = torch.tensor(sample.prompt_ids + sample.response_ids)
        attention_mask[row, :total] = 1
        loss_mask[row, response_targets(sample)] = 1.0
    behaviour = per_token("logprobs")
    old = per_token("old_logprobs")
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        old_logprobs=behaviour.clone() if old is None else old,
        advantages=torch.zeros_like(loss_mask),
        ref_logprobs=per_token("ref_logprobs"),
        old_values=per_token("values"),
    )


def response_targets(sample: Sample) -> slice:
    """The target positions of `sample`'s response in a batch row: position t predicts token
    t+1, so the response occupies targets prompt_len-1 .. prompt_len+response_len-2."""
    prompt_len = len(sample.prompt_ids)
    return slice(prompt_len - 1, prompt_len + len(sample.response_ids) - 1)


def per_sample(values: torch.Tensor, samples: list[Sample]) -> list[list[float]]:
    """The response part of each row of `values` [B, T-1], as one list per sample."""
    return [values[row, response_targets(s)].tolist() for row, s in enumerate(samples)]
