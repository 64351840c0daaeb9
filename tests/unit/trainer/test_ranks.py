"""How a rank cuts its rows into micro-batches: longest first, each cut to its longest row,
with results scattered back in row order and the objective unchanged."""

from __future__ import annotations

import pytest
import torch

from rl.batching import build_batch
from rl.config import AlgorithmConfig
from rl.loss import loss_weights, policy_objective
from rl.types import Batch, Sample
from trainer.ranks import micro_batches, rank_rows, scatter_rows

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


def test_micro_batches_go_longest_first_and_are_cut_to_their_longest_row() -> None:
    batch = _batch([2, 9, 4, 12, 1, 7])
    micros = list(micro_batches(batch, rank=0, world_size=1, micro_batch_size=2, device=CPU))
    assert [rows.tolist() for _, rows in micros] == [[3, 1], [5, 2], [0, 4]]
    assert [micro.input_ids.shape[1] for micro, _ in micros] == [15, 10, 5]  # prompt 3 + longest
    assert all(m.loss_mask.shape[1] == m.input_ids.shape[1] - 1 for m, _ in micros)


def test_a_rank_short_of_rows_runs_a_dummy_micro_batch_without_rows() -> None:
    batch = _batch([3, 5, 2])  # 2 ranks: rank 0 has 2 rows, rank 1 one
    micros = list(micro_batches(batch, rank=1, world_size=2, micro_batch_size=1, device=CPU))
    assert micros[0][1].tolist() == [0] and micros[1][1] is None
    assert micros[1][0].loss_mask.sum() == 0


def test_scattered_outputs_equal_a_pass_over_the_whole_padded_batch() -> None:
    batch = _batch([2, 9, 4, 12, 1, 7, 5])
    for rank in range(2):
        mine = rank_rows(batch.num_sequences, rank, 2)
        pieces = [
            (rows, _logprobs(micro))
            for micro, rows in micro_batches(batch, rank, 2, micro_batch_size=2, device=CPU)
            if rows is not None
        ]
        whole = _logprobs(batch.select(mine)) * batch.loss_mask[mine]
        scattered = scatter_rows(pieces, mine.stop - mine.start, batch.input_ids.shape[1] - 1)
        assert torch.equal(scattered * batch.loss_mask[mine], whole)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_the_objective_over_sorted_cut_micro_batches_is_the_full_batch_objective(
    agg: str,
) -> None:
    cfg = AlgorithmConfig(loss_agg=agg)
    batch = _batch([2, 9, 4, 12, 1, 7, 5, 3])
    denominator = loss_weights(cfg, batch.loss_mask, MAX_NEW)[1].item()
    logprobs = _logprobs(batch)
    full, _ = policy_objective(
        cfg, logprobs, torch.zeros_like(logprobs), batch, MAX_NEW, denominator
    )
    parts = 0.0
    for micro, _ in micro_batches(batch, 0, 1, micro_batch_size=3, device=CPU):
        lp = _logprobs(micro)
        parts += policy_objective(cfg, lp, torch.zeros_like(lp), micro, MAX_NEW, denominator)[0]
    assert torch.allclose(full, parts, atol=1e-6)
