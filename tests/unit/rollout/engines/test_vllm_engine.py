"""The vLLM engine's arguments chosen from the recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.config import RolloutConfig
from rl.types import Sample
from rollout.engines.vllm_engine import engine_args, extend_record


@pytest.mark.parametrize(("compile", "eager"), [(None, True), (True, False), (False, True)])
def test_rollout_compile_sets_vllm_eager_mode_and_cpu_defaults_to_eager(
    compile: bool | None, eager: bool
) -> None:
    args = engine_args("/some/model", RolloutConfig(compile=compile), "float32", seed=0)
    assert args["enforce_eager"] is eager


def test_recording_routing_on_cpu_is_refused_with_vllms_reason() -> None:
    assert (
        engine_args("/m", RolloutConfig(), "float32", seed=0)["enable_return_routed_experts"]
        is False
    )
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton.*rollout.engine=torch"):
        engine_args("/m", RolloutConfig(), "float32", seed=0, record_routing=True)


def test_routing_rows_vllm_returns_extend_a_samples_record_to_one_row_per_position_run() -> None:
    """vLLM's routed_experts: [positions, layers, k] from the request's
    routed_experts_prompt_start to the last position it ran (its last token is never run)."""
    sample = Sample([1, 2, 3], 0, response_ids=[4, 5])  # generated: 5 tokens, 4 positions run
    first = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)
    extend_record(sample, first)
    assert sample.routed_experts.dtype == torch.uint8
    assert torch.equal(sample.routed_experts, torch.from_numpy(first))
    # Resumed as a prompt of 5 tokens from position 4, it sampled 2 more: positions 4 and 5.
    sample.response_ids += [6, 7]
    more = np.full((2, 2, 2), 300, dtype=np.int16)
    extend_record(sample, more)
    assert sample.routed_experts.dtype == torch.int16 and len(sample.routed_experts) == 6
    assert sample.routed_experts[4:].eq(300).all() and torch.equal(
        sample.routed_experts[:4], torch.from_numpy(first).to(torch.int16)
    )
    with pytest.raises(AssertionError, match="routing record of 7 positions for a sample of 7"):
        extend_record(sample, more[:1])
