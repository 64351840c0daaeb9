"""Shared-prompt micro-batches: one row per prompt, each response attending to the prompt and
to itself, and the padded layout's log-probs, entropy, loss and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.attention import ATTENTION
from rl.config import TrainerConfig
from rl.types import Batch
from tests.unit.trainer.layouts import assert_same_loss_and_gradients
from trainer.fsdp import LogProbModel
from trainer.packing import padded_input
from trainer.prompt_sharing import prompt_groups, shared_prompt_input
from trainer.ranks import micro_batches

# (prompt, response lengths): two groups of one prompt each, a prompt of its own, and a row
# with nothing to train (a prompt of its own too).
GROUPS = [(6, [4, 1, 7]), (3, [5, 2]), (9, [3])]
UNTRAINED_LENGTH = 8


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(2)
    rows = []  # (tokens, prompt length)
    for prompt_length, responses in GROUPS:
        prompt = torch.randint(1, 64, (prompt_length,), generator=gen)
        for n in responses:
            rows.append(
                (torch.cat([prompt, torch.randint(1, 64, (n,), generator=gen)]), prompt_length)
            )
    rows.append((torch.randint(1, 64, (UNTRAINED_LENGTH,), generator=gen), UNTRAINED_LENGTH))
    width = max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (tokens, prompt_length) in enumerate(rows):
        input_ids[i, : len(tokens)], attention_mask[i, : len(tokens)] = tokens, 1
        loss_mask[i, prompt_length - 1 : len(tokens) - 1] = 1.0
    advantages = torch.randn(len(rows), 1, generator=gen) * loss_mask
    old = -3.0 * loss_mask
    return Batch(input_ids, attention_mask, loss_mask, old, old, advantages)


@pytest.fixture(params=["sdpa", ATTENTION])
def model(tiny_model_dir: Path, request: pytest.FixtureRequest) -> LogProbModel:
    causal_lm = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=request.param
    ).eval()
    return LogProbModel(causal_lm, TrainerConfig(logprob_chunk_size=7))


def test_rows_with_the_same_prompt_become_one_row_with_the_prompt_once() -> None:
    batch = _batch()
    assert prompt_groups(batch) == [(6, [0, 1, 2]), (3, [3, 4]), (9, [5]), (8, [6])]
    inputs = shared_prompt_input(batch)
    assert inputs.input_ids.shape == (4, 6 + 4 + 1 + 7)
    assert inputs.position_ids[0].tolist() == [*range(6), *range(6, 10), 6, *range(6, 13)]
    computed = int((inputs.input_ids != 0).sum())  # every token id of the batch is >= 1
    assert computed == int(batch.attention_mask.sum()) - 2 * 6 - 3  # 2 and 1 prompts shared
    mask = inputs.attention_mask[0, 0]
    first, second = range(6, 10), 10  # the first two responses' positions
    assert mask[second, :6].all() and not mask[second, first].any() and mask[second, second]


def test_shared_logprobs_and_entropy_equal_the_padded_ones(model: LogProbModel) -> None:
    batch = _batch()
    with torch.no_grad():
        padded = model(padded_input(batch), 0.8)
        shared = model(shared_prompt_input(batch), 0.8)
    for a, b in zip(padded, shared, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert padded[0][batch.loss_mask.bool()].abs().min() > 0


def test_responses_that_saw_each_other_would_score_differently(model: LogProbModel) -> None:
    """The check above has teeth: with a plain causal mask over the shared row, a response
    reads the responses before it, and its log-probs move."""
    batch = _batch()
    inputs = shared_prompt_input(batch)
    width = inputs.input_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    inputs.attention_mask = causal.expand_as(inputs.attention_mask)
    with torch.no_grad():
        padded, leaking = model(padded_input(batch), 0.8)[0], model(inputs, 0.8)[0]
    assert (padded - leaking)[2].abs().max() > 1e-2  # the third response, after two others


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_shared_and_padded_give_the_same_loss_and_gradients(model: LogProbModel, agg: str) -> None:
    assert_same_loss_and_gradients(model, _batch(), shared_prompt_input, agg)


def test_the_trainer_setting_gives_each_micro_batch_the_shared_layout() -> None:
    cfg = TrainerConfig(share_prompts=True, micro_batch_size=4)
    layouts = [inputs for _, inputs, _ in micro_batches(_batch(), 0, 1, cfg, torch.device("cpu"))]
    # Rows 0-3 (a group of 3 and the first of a pair), then rows 4-6.
    assert [inputs.input_ids.shape[0] for inputs in layouts] == [2, 3]
    assert all(inputs.hidden_index is not None for inputs in layouts)
