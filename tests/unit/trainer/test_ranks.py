"""How a rank cuts its rows into micro-batches, each cut to its longest row, padded or packed,
with results scattered back in row order and the objective unchanged."""

from __future__ import annotations

import pytest
import torch

from rl.algorithms.objective import loss_weights, policy_objective
from rl.config import AlgorithmConfig, TrainerConfig
from rl.run.batching import build_batch
from rl.types import Batch, Sample
from trainer.packing import packed_input
from trainer.ranks import micro_batches, scatter_rows, to_device

CPU = torch.device("cpu")
MAX_NEW = 12


def _batch(response_lengths: list[int]) -> Batch:
    samples = [
        Sample(
            prompt_ids=[1, 2, 3],
            group_id=i,
            index=0,
            response_ids=list(range(10, 10 + n)),
            logprobs=[-0.5] * n,
        )
        for i, n in enumerate(response_lengths)
    ]
    batch = build_batch(samples, pad_id=0)
    torch.manual_seed(0)
    batch.advantages = torch.randn(len(samples), 1) * batch.loss_mask
    return batch


def _logprobs(micro: Batch) -> torch.Tensor:
    """A stand-in model: each target's log-prob depends on its token alone."""
    return -0.01 * micro.input_ids[:, 1:].float()


def _micro_batches(batch: Batch, rank: int, world_size: int, **trainer: object) -> list:
    return list(micro_batches(batch, rank, world_size, TrainerConfig(**trainer), CPU))


def test_fixed_micro_batches_keep_the_row_order_and_are_cut_to_their_longest_row() -> None:
    batch = _batch([2, 9, 4, 12, 1, 7])
    micros = _micro_batches(batch, 0, 1, micro_batch_size=2)
    assert [rows.tolist() for _, _, rows in micros] == [[0, 1], [2, 3], [4, 5]]
    assert [micro.input_ids.shape[1] for micro, _, _ in micros] == [
        12,
        15,
        10,
    ]  # prompt 3 + longest


def test_token_budget_micro_batches_go_longest_first() -> None:
    batch = _batch([2, 9, 4, 12, 1, 7])  # 5, 12, 7, 15, 4, 10 tokens
    micros = _micro_batches(batch, 0, 1, micro_batch_tokens=30)
    assert [rows.tolist() for _, _, rows in micros] == [[3, 1], [5, 2, 0], [4]]
    assert all(m.loss_mask.shape[1] == m.input_ids.shape[1] - 1 for m, _, _ in micros)


def test_a_token_budget_counts_padded_positions_or_packed_rows() -> None:
    batch = _batch([9, 1, 1, 1, 5])  # 12, 4, 4, 4, 8 tokens with the prompt
    padded = _micro_batches(batch, 0, 1, micro_batch_tokens=24)
    assert [rows.tolist() for _, _, rows in padded] == [[0, 4], [1, 2, 3]]
    packed = _micro_batches(batch, 0, 1, micro_batch_tokens=12, packing=True)
    # one row of 12 (the longest) a micro-batch: [12], [8, 4], [4, 4]
    assert [rows.tolist() for _, _, rows in packed] == [[0], [4, 1], [2, 3]]
    for _, inputs, _ in packed:
        assert inputs.input_ids.shape == (1, 12) and inputs.attention_mask is None


def test_a_rank_short_of_micro_batches_runs_a_dummy_without_rows() -> None:
    batch = _batch([3, 5, 2])  # 2 ranks: rank 0 has 2 rows, rank 1 one
    micros = _micro_batches(batch, 1, 2, micro_batch_size=1)
    assert micros[0][2].tolist() == [2] and micros[1][2] is None
    assert micros[1][0].loss_mask.sum() == 0


@pytest.mark.parametrize("trainer", [{"micro_batch_size": 2}, {"micro_batch_tokens": 30}])
def test_every_row_lands_on_exactly_one_rank_and_scatters_back_in_place(trainer: dict) -> None:
    batch = _batch([2, 9, 4, 12, 1, 7, 5])
    whole = torch.zeros(batch.num_sequences, batch.input_ids.shape[1] - 1)
    for rank in range(2):
        pieces = [
            (rows, _logprobs(micro))
            for micro, _, rows in _micro_batches(batch, rank, 2, **trainer)
            if rows is not None
        ]
        whole += scatter_rows(pieces, batch, CPU)  # what gather_rows' all-reduce adds up
    expected = _logprobs(batch) * batch.attention_mask[:, 1:]
    assert torch.equal(whole * batch.attention_mask[:, 1:], expected)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("trainer", [{"micro_batch_size": 3}, {"micro_batch_tokens": 25}])
def test_the_objective_over_sorted_cut_micro_batches_is_the_full_batch_objective(
    agg: str, trainer: dict
) -> None:
    cfg = AlgorithmConfig(loss_agg=agg)
    batch = _batch([2, 9, 4, 12, 1, 7, 5, 3])
    denominator = loss_weights(cfg, batch.loss_mask, MAX_NEW)[1].item()
    logprobs = _logprobs(batch)
    full, _ = policy_objective(
        cfg, logprobs, torch.zeros_like(logprobs), batch, MAX_NEW, denominator
    )
    parts = 0.0
    for micro, _, _ in _micro_batches(batch, 0, 1, **trainer):
        lp = _logprobs(micro)
        parts += policy_objective(cfg, lp, torch.zeros_like(lp), micro, MAX_NEW, denominator)[0]
    assert torch.allclose(full, parts, atol=1e-6)


def test_every_tensor_of_a_model_input_goes_to_the_device_its_segments_too() -> None:
    lengths = torch.tensor([5, 2, 3])
    mask = (torch.arange(5) < lengths[:, None]).long()
    loss_mask = mask[:, 1:].float()
    inputs = packed_input(Batch(mask * 7, mask, loss_mask, loss_mask, loss_mask, loss_mask))
    # The 2- and 3-token samples share a row; 5, 3 and 2 are too far apart to batch together.
    assert len(inputs.segments.gathers) == 3
    moved = to_device(inputs, torch.device("meta"))
    tensors = [moved.input_ids, moved.position_ids, moved.targets, moved.unpack_index]
    segments = moved.segments
    tensors += [segments.starts, segments.scatter, *segments.gathers]
    assert all(t.device.type == "meta" for t in tensors)
    assert segments.longest == inputs.segments.longest and moved.attention_mask is None
