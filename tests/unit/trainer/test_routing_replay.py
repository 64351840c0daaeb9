"""The trainer's forward replays a batch's routing record (rl.expert_routing) in every micro-batch
layout: padded, packed and shared-prompt rows route each token as the padded layout does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.attention import ATTENTION
from rl.config import TrainerConfig
from rl.expert_routing import NATURAL, moe_routers
from tests.helpers.models import build_moe_checkpoint
from tests.unit.trainer.layouts import assert_same_loss_and_gradients
from tests.unit.trainer.test_prompt_sharing import GROUPS, _batch
from trainer.fsdp import LogProbModel
from trainer.packing import packed_input, padded_input
from trainer.prompt_sharing import shared_prompt_input

LAYERS, TOP_K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture
def model(moe_dir: Path) -> LogProbModel:
    causal_lm = AutoModelForCausalLM.from_pretrained(
        moe_dir, dtype=torch.float32, attn_implementation=ATTENTION
    )
    for router in moe_routers(causal_lm):  # distinct choices, far from ties
        torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return LogProbModel(causal_lm, TrainerConfig(logprob_chunk_size=7))


def _recorded_batch():
    """`_batch()` with a routing record as an engine writes one: a group's prompt positions
    routed alike (one prefill), every response position its own, drawn at random; the
    untrained row's last position and the padding unrecorded."""
    batch = _batch()
    gen = torch.Generator().manual_seed(3)
    rows, width = batch.input_ids.shape
    draws = torch.rand(rows, width, LAYERS, EXPERTS, generator=gen).argsort(dim=-1)
    routing = draws[..., :TOP_K].to(torch.int16)
    row = 0
    for prompt_length, responses in GROUPS:
        routing[row : row + len(responses), :prompt_length] = routing[row, :prompt_length].clone()
        row += len(responses)
    lengths = batch.attention_mask.sum(dim=1)
    for r, length in enumerate(lengths.tolist()):
        routing[r, length - 1 :] = NATURAL
    return dataclasses.replace(batch, routing=routing)


def test_the_forward_routes_each_recorded_position_to_its_record(model: LogProbModel) -> None:
    batch = _recorded_batch()
    with torch.no_grad():
        replayed, _ = model(padded_input(batch), 1.0)
        used = model.routing.recorded().reshape(*batch.input_ids.shape, LAYERS, TOP_K)
        free, _ = model(padded_input(dataclasses.replace(batch, routing=None)), 1.0)
    recorded = batch.routing != NATURAL
    assert torch.equal(used[recorded], batch.routing[recorded].long())
    assert not torch.allclose(replayed, free, atol=1e-4), "the record must change the routing"


@pytest.mark.parametrize("layout", [packed_input, shared_prompt_input])
def test_every_layout_replays_as_the_padded_one(model: LogProbModel, layout) -> None:
    assert_same_loss_and_gradients(model, _recorded_batch(), layout, "token-mean")
