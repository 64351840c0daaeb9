"""The micro-batch plan: Karmarkar-Karp balance across ranks, token budgets, fixed counts."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from trainer.micro_batching import (
    balanced_partition,
    fill_by_tokens,
    fill_packed,
    num_micro_batches,
    pack_rows,
    plan_micro_batches,
    rank_rows,
    rank_token_imbalance,
)


def _differencing_spread(costs: list[int]) -> int:
    """Two-way Karmarkar-Karp by hand: replace the two largest by their difference."""
    heap = [-cost for cost in costs]
    heapq.heapify(heap)
    while len(heap) > 1:
        largest, second = -heapq.heappop(heap), -heapq.heappop(heap)
        heapq.heappush(heap, -(largest - second))
    return -heap[0]


def test_balanced_partition_uses_every_index_once() -> None:
    costs = [random.Random(0).randint(1, 100) for _ in range(37)]
    parts = balanced_partition(costs, 3)
    assert sorted(itertools.chain(*parts)) == list(range(37))
    assert all(part == sorted(part) for part in parts)


def test_balanced_partition_beats_greedy_largest_first() -> None:
    # Greedy (each, largest first, into the lighter set): {8, 5, 4}, {7, 6} = 17 / 13.
    # Differencing: 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2: {8, 6, 4}... = 16 / 14.
    costs = [8, 7, 6, 5, 4]
    parts = balanced_partition(costs, 2)
    assert sorted(sum(costs[i] for i in part) for part in parts) == [14, 16]


@pytest.mark.parametrize("seed", range(5))
def test_two_way_partition_reaches_the_differencing_spread(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.randint(32, 128) for _ in range(9)]
    totals = [sum(costs[i] for i in part) for part in balanced_partition(costs, 2)]
    assert max(totals) - min(totals) == _differencing_spread(costs)


def test_more_parts_than_items_leaves_empty_parts() -> None:
    assert sorted(balanced_partition([5, 3], 4)) == [[], [], [0], [1]]


def test_a_padded_micro_batch_holds_rows_times_its_longest_within_the_budget() -> None:
    lengths = [10, 10, 6, 3, 3]
    assert fill_by_tokens([0, 1, 2, 3, 4], lengths, 20) == [[0, 1], [2, 3, 4]]
    assert fill_by_tokens([0, 1, 2, 3, 4], lengths, 19) == [[0], [1], [2, 3, 4]]


def test_a_row_longer_than_the_budget_forms_its_own_micro_batch() -> None:
    assert fill_by_tokens([0, 1], [50, 5], 20) == [[0], [1]]


def test_rows_are_packed_first_fit_longest_first() -> None:
    assert pack_rows([20, 5, 13, 2, 9, 17, 11, 1], 20) == [[0], [5, 3, 7], [2, 1], [6, 4]]


def test_packed_micro_batches_pair_long_samples_with_short_ones() -> None:
    lengths = [16, 4, 12, 8, 8, 15, 1]
    rows = [0, 1, 2, 3, 4, 5, 6]
    # rows of 16: [0], [5, 6], [2, 1], [3, 4]; two rows (32 positions) to a micro-batch
    assert fill_packed(rows, lengths, 16, 32) == [[0, 5, 6], [2, 1, 3, 4]]
    assert fill_packed(rows, lengths, 16, 8) == [[0], [5, 6], [2, 1], [3, 4]]  # at least a row


def test_the_fixed_plan_is_contiguous_rows_in_order() -> None:
    lengths = [1, 5, 3, 9, 2, 7, 4]
    plan = plan_micro_batches(lengths, 2, micro_batch_size=2, micro_batch_tokens=0, packed=False)
    assert plan == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    for rank, micros in enumerate(plan):
        owned = range(7)[rank_rows(7, rank, 2)]
        assert sorted(itertools.chain(*micros)) == list(owned)


def test_the_token_plan_balances_tokens_across_ranks() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(32, 128) for _ in range(64)]
    plan = plan_micro_batches(lengths, 2, micro_batch_size=8, micro_batch_tokens=1024, packed=True)
    assert rank_token_imbalance(plan, lengths) < 1.01
    rows = sorted(row for rank in plan for micro in rank for row in micro)
    assert rows == list(range(64))
    for rank in plan:  # packed into rows of the longest (128): 8 rows to a micro-batch
        for micro in rank:
            assert len(pack_rows([lengths[row] for row in micro], 128)) <= 1024 // 128
    # against contiguous halves of the rows, had they arrived sorted by length
    ordered = sorted(lengths)
    assert rank_token_imbalance([[list(range(32))], [list(range(32, 64))]], ordered) > 1.2


def test_every_rank_runs_the_largest_count_and_at_least_one() -> None:
    assert num_micro_batches([[[0], [1], [2]], [[3]]]) == 3
    assert num_micro_batches([[], []]) == 1
