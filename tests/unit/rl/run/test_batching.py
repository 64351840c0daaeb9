"""Samples become right-padded tensors whose masks line up with the response targets."""

from __future__ import annotations

import pytest
import torch

from rl.run.batching import build_batch, per_sample
from rl.types import NOT_SAMPLED, Sample


def test_response_targets_are_masked_and_carry_behaviour_logprobs() -> None:
    samples = [
        Sample(
            prompt_ids=[5, 6],
            response_ids=[7, 8, 9],
            logprobs=[-0.1, -0.2, -0.3],
            finish_reason="stop",
            group_id=0,
        ),
        Sample(
            prompt_ids=[5, 6, 4],
            response_ids=[1],
            logprobs=[-0.5],
            finish_reason="length",
            group_id=1,
        ),
    ]
    batch = build_batch(samples, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 4, 1, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # Target t predicts token t+1: the first response token is predicted from the last prompt token.
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert torch.allclose(batch.behaviour_logprobs[0], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    assert torch.allclose(batch.behaviour_logprobs[1], torch.tensor([0.0, 0.0, -0.5, 0.0]))
    # The proximal policy starts as the behaviour policy, in its own tensor.
    assert torch.equal(batch.old_logprobs, batch.behaviour_logprobs)
    assert batch.old_logprobs.data_ptr() != batch.behaviour_logprobs.data_ptr()
    assert batch.advantages.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_select_takes_the_same_rows_of_every_tensor() -> None:
    samples = [
        Sample(
            prompt_ids=[1],
            response_ids=[i],
            logprobs=[-float(i)],
            finish_reason="stop",
            group_id=i,
        )
        for i in range(1, 5)
    ]
    batch = build_batch(samples, pad_id=0)
    part = batch.select(slice(1, 3))
    assert part.num_sequences == 2
    assert part.input_ids[:, 1].tolist() == [2, 3]
    assert part.old_logprobs[:, 0].tolist() == [-2.0, -3.0]


def test_annotations_fill_their_tensors_on_the_response_targets() -> None:
    samples = [
        Sample([5, 6], group_id=0, response_ids=[7, 8], logprobs=[-0.1, -0.2]),
        Sample([5], group_id=1, response_ids=[9], logprobs=[-0.3]),
    ]
    for sample in samples:
        n = len(sample.response_ids)
        sample.old_logprobs, sample.ref_logprobs, sample.values = [-1.0] * n, [-2.0] * n, [0.5] * n
    batch = build_batch(samples, pad_id=0)
    assert batch.old_logprobs.tolist() == [[0, -1, -1], [-1, 0, 0]]
    assert batch.ref_logprobs.tolist() == [[0, -2, -2], [-2, 0, 0]]
    assert batch.old_values.tolist() == [[0, 0.5, 0.5], [0.5, 0, 0]]
    assert per_sample(batch.ref_logprobs, samples) == [[-2.0, -2.0], [-2.0]]


def test_a_batch_without_every_samples_annotation_has_none() -> None:
    samples = [Sample([5], group_id=0, response_ids=[7], logprobs=[-0.1], values=[1.0])]
    samples.append(Sample([5], group_id=1, response_ids=[8], logprobs=[-0.2]))
    batch = build_batch(samples, pad_id=0)
    assert batch.old_values is None and batch.ref_logprobs is None


def multi_turn_sample() -> Sample:
    """Prompt [5, 6]; a turn [7, 8] sampled by version 2, an observation [20, 21, 22] the
    environment inserted, a last turn [9] sampled by version 3."""
    return Sample(
        prompt_ids=[5, 6],
        group_id=0,
        response_ids=[7, 8, 20, 21, 22, 9],
        logprobs=[-0.1, -0.2, 0.0, 0.0, 0.0, -0.3],
        token_versions=[2, 2, NOT_SAMPLED, NOT_SAMPLED, NOT_SAMPLED, 3],
        loss_mask=[1, 1, 0, 0, 0, 1],
    )


def test_a_multi_turn_sample_trains_on_its_sampled_targets_only() -> None:
    single = Sample([5], group_id=1, response_ids=[4], logprobs=[-0.5])
    batch = build_batch([multi_turn_sample(), single], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 20, 21, 22, 9], [5, 4, 0, 0, 0, 0, 0, 0]]
    # Target t is token t+1: 7 and 8 at targets 1, 2 (sampled), 20, 21, 22 at 3, 4, 5
    # (observation), 9 at 6 (sampled); the single-turn row's 4 at target 0.
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert torch.allclose(
        batch.behaviour_logprobs[0], torch.tensor([0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3])
    )


def test_policy_version_is_the_oldest_sampled_tokens_not_an_observations() -> None:
    assert multi_turn_sample().policy_version == 2
    sample = multi_turn_sample()
    # Whichever sampled token is the oldest, not the first.
    sample.token_versions = [5, 5, NOT_SAMPLED, NOT_SAMPLED, NOT_SAMPLED, 4]
    assert sample.policy_version == 4


def test_a_sample_whose_turn_is_still_being_generated_is_refused() -> None:
    sample = multi_turn_sample()
    # The engine appended a turn [10, 11] that end_turn has not closed: no mask for it yet.
    sample.response_ids += [10, 11]
    sample.logprobs += [-0.4, -0.5]
    sample.token_versions += [3, 3]
    with pytest.raises(AssertionError, match="a turn is still being generated"):
        build_batch([sample], pad_id=0)
