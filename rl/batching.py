"""Samples -> padded training `Batch`."""

from __future__ import annotations

import torch

from rl.types import Batch, Sample


def build_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int) -> Batch:
    """Right-padded tensors for `samples`; advantages [B] are broadcast over each response.

    Behaviour log-probs from the rollout become `old_logprobs`; the driver may replace them
    with trainer-recomputed ones.
    """
    assert advantages.shape == (len(samples),)
    max_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    num = len(samples)
    input_ids = torch.full((num, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num, max_len), dtype=torch.long)
    loss_mask = torch.zeros((num, max_len - 1), dtype=torch.float32)
    old_logprobs = torch.zeros((num, max_len - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt_len, response_len = len(sample.prompt_ids), len(sample.response_ids)
        total = prompt_len + response_len
        input_ids[row, :total] = torch.tensor(sample.prompt_ids + sample.response_ids)
        attention_mask[row, :total] = 1
        # Target position t predicts token t+1: the response occupies targets prompt_len-1 ..
        targets = slice(prompt_len - 1, total - 1)
        loss_mask[row, targets] = 1.0
        old_logprobs[row, targets] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        advantages=advantages.float()[:, None] * loss_mask,
    )
