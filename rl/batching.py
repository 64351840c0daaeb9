"""Samples -> padded training `Batch`."""

from __future__ import annotations

import torch

from rl.types import Batch, Sample


def build_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-padded tensors for `samples`, advantages still zero.

    The behaviour log-probs recorded by the rollout are also the initial `old_logprobs` (the
    proximal policy); the driver replaces them when the trainer recomputes them.
    """
    max_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    num = len(samples)
    input_ids = torch.full((num, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num, max_len), dtype=torch.long)
    loss_mask = torch.zeros((num, max_len - 1), dtype=torch.float32)
    behaviour = torch.zeros((num, max_len - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt_len, response_len = len(sample.prompt_ids), len(sample.response_ids)
        total = prompt_len + response_len
        input_ids[row, :total] = torch.tensor(sample.prompt_ids + sample.response_ids)
        attention_mask[row, :total] = 1
        # Target position t predicts token t+1: the response occupies targets prompt_len-1 ..
        targets = slice(prompt_len - 1, total - 1)
        loss_mask[row, targets] = 1.0
        behaviour[row, targets] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        old_logprobs=behaviour.clone(),
        advantages=torch.zeros_like(loss_mask),
    )
