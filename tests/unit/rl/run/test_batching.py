"""Samples become right-padded tensors whose masks line up with the response targets."""

from __future__ import annotations

import torch

from rl.run.batching import build_batch, per_sample
from rl.types import Sample


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
