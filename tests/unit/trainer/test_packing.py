"""Packed micro-batches: samples end to end, attention within a sample, the padded results."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.config import TrainerConfig
from rl.types import Batch
from tests.unit.trainer.layouts import assert_same_loss_and_gradients
from trainer.fsdp import LogProbModel
from trainer.packing import IGNORE, packed_input, padded_input

LENGTHS = [20, 5, 13, 2, 9, 17, 11, 1]


@pytest.fixture
def model(tiny_model_dir: Path) -> LogProbModel:
    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return LogProbModel(causal_lm, TrainerConfig(logprob_chunk_size=7))


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    width = max(LENGTHS)
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    input_ids = torch.randint(1, 64, (len(LENGTHS), width), generator=gen) * attention_mask
    loss_mask = ((torch.arange(1, width) >= 2) & (attention_mask[:, 1:] == 1)).float()
    advantages = torch.randn(len(LENGTHS), 1, generator=gen) * loss_mask
    old = -3.0 * loss_mask
    return Batch(input_ids, attention_mask, loss_mask, old, old, advantages)


def test_a_packed_row_restarts_positions_and_scores_nothing_across_samples() -> None:
    inputs = packed_input(_batch())
    assert inputs.attention_mask is None
    assert inputs.input_ids.shape == (4, 20)
    row = 2  # samples 2 (13 tokens) then 1 (5 tokens), then 2 positions of tail
    assert inputs.position_ids[row].tolist() == [*range(13), *range(5), 0, 1]
    assert inputs.targets[row, 12] == IGNORE  # sample 2's last token: the next is sample 1's
    assert (inputs.targets[row, 18:] == IGNORE).all()  # the tail


def test_packed_logprobs_and_entropy_equal_the_padded_ones(model: LogProbModel) -> None:
    batch = _batch()
    with torch.no_grad():
        padded = model(padded_input(batch), 0.8)
        packed = model(packed_input(batch), 0.8)
    for a, b in zip(padded, packed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert padded[0][0].abs().sum() > 0


def test_without_the_restarted_positions_tokens_would_attend_across_samples(
    model: LogProbModel,
) -> None:
    """The check above has teeth: the same packed rows read as one sequence each differ."""
    batch = _batch()
    leaking = dataclasses.replace(packed_input(batch), position_ids=None)
    with torch.no_grad():
        padded, packed = model(padded_input(batch), 0.8)[0], model(leaking, 0.8)[0]
    assert (padded - packed).abs().max() > 1e-2


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_and_padded_give_the_same_loss_and_gradients(model: LogProbModel, agg: str) -> None:
    assert_same_loss_and_gradients(model, _batch(), packed_input, agg)
