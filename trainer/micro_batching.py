"""Which rows of a mini-batch each rank trains on, in which micro-batches: pure logic.

Every rank receives the same full mini-batch and computes the same plan for all ranks, so the
ranks agree on the number of micro-batches (each one's forward and backward runs FSDP
collectives) without exchanging a message.

Two ways to cut:
- fixed: rank r takes the contiguous rows `rank_rows`, in order, in micro-batches of
  `micro_batch_size` rows (as verl and OpenRLHF do without dynamic batching);
- by token budget (`micro_batch_tokens` > 0): rows are dealt to the ranks by Karmarkar-Karp
  differencing on their lengths, so every rank has about the same number of tokens to compute
  and none waits for another at a collective, then each rank fills micro-batches up to the
  budget: padded, longest first (a micro-batch holds rows of similar length, so little
  padding); packed, its samples first-fit into rows as wide as the mini-batch's longest and
  then as many of those rows to a micro-batch as the budget holds.
"""

from __future__ import annotations

import heapq


def rank_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """Rows of a `num_rows` batch that `rank` owns: contiguous, sizes differ by at most one.

    The first `num_rows % world_size` ranks get one extra row.
    """
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def balanced_partition(costs: list[int], num_parts: int) -> list[list[int]]:
    """Indices of `costs` in `num_parts` sets of near-equal total cost (Karmarkar-Karp).

    The largest differencing method: every item starts as a partial solution with the item in
    one set; the two partial solutions with the largest spread (max - min total) are merged,
    the heaviest set of one with the lightest of the other, until one remains. Deterministic:
    ties break by insertion order. Each set is returned in ascending index order.
    """
    assert num_parts >= 1
    # Entries: (-spread, order, [(total, indices), ...] heaviest first).
    heap = []
    for order, (index, cost) in enumerate(sorted(enumerate(costs), key=lambda ic: -ic[1])):
        sets = [(cost, [index])] + [(0, []) for _ in range(num_parts - 1)]
        heap.append((-cost, order, sets))
    heapq.heapify(heap)
    order = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # heaviest of one with lightest of the other: the spreads cancel as far as they can
        merged = [
            (a_total + b_total, a_indices + b_indices)
            for (a_total, a_indices), (b_total, b_indices) in zip(
                first, reversed(second), strict=True
            )
        ]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], order, merged))
        order += 1
    parts = [sorted(indices) for _, indices in heap[0][2]] if heap else []
    return parts + [[] for _ in range(num_parts - len(parts))]


def longest_first(rows: list[int], lengths: list[int]) -> list[int]:
    """`rows` ordered by decreasing `lengths[row]` (stable)."""
    return sorted(rows, key=lambda row: -lengths[row])


def fill_by_tokens(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`rows` (longest first) cut greedily into padded micro-batches of at most `budget`
    positions: rows x the first (longest) row's length. A row longer than the budget alone
    still forms a micro-batch."""
    micro_batches: list[list[int]] = []
    for row in rows:
        if micro_batches and (len(micro_batches[-1]) + 1) * lengths[micro_batches[-1][0]] <= budget:
            micro_batches[-1].append(row)
        else:
            micro_batches.append([row])
    return micro_batches


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Samples (by index, longest first) placed first-fit into rows of `width` positions."""
    rows: list[list[int]] = []
    free: list[int] = []
    for sample in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, room in enumerate(free) if room >= lengths[sample]), None)
        if slot is None:
            rows.append([])
            free.append(width)
            slot = len(rows) - 1
        rows[slot].append(sample)
        free[slot] -= lengths[sample]
    return rows


def fill_packed(rows: list[int], lengths: list[int], width: int, budget: int) -> list[list[int]]:
    """`rows` packed first-fit into rows of `width` positions, those rows then grouped
    `budget // width` (at least one) to a micro-batch: each micro-batch is the samples of its
    packed rows. Packing a rank's rows together pairs its long samples with its short ones,
    where packing each length-sorted micro-batch alone would find nothing to pair."""
    packed = [[rows[i] for i in row] for row in pack_rows([lengths[r] for r in rows], width)]
    per_micro_batch = max(1, budget // width)
    return [
        [sample for row in packed[i : i + per_micro_batch] for sample in row]
        for i in range(0, len(packed), per_micro_batch)
    ]


def plan_micro_batches(
    lengths: list[int],
    world_size: int,
    micro_batch_size: int,
    micro_batch_tokens: int,
    packed: bool,
) -> list[list[list[int]]]:
    """plan[rank] = that rank's micro-batches, each a list of row indices of the mini-batch
    (`lengths[row]` real tokens). Ranks may have different numbers of micro-batches (the
    caller pads with dummies to the largest) and a rank may have none."""
    num_rows = len(lengths)
    if micro_batch_tokens <= 0:
        plan = []
        for rank in range(world_size):
            mine = list(range(num_rows)[rank_rows(num_rows, rank, world_size)])
            plan.append(
                [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
            )
        return plan
    parts = balanced_partition(lengths, world_size)
    if packed:
        width = max(lengths)
        return [fill_packed(part, lengths, width, micro_batch_tokens) for part in parts]
    return [
        fill_by_tokens(longest_first(part, lengths), lengths, micro_batch_tokens) for part in parts
    ]


def num_micro_batches(plan: list[list[list[int]]]) -> int:
    """How many micro-batches every rank runs: the most any rank has, at least one."""
    return max(1, max(len(rank) for rank in plan))


def rank_token_imbalance(plan: list[list[list[int]]], lengths: list[int]) -> float:
    """max / mean of the ranks' real tokens (1.0 = perfectly balanced)."""
    totals = [sum(lengths[row] for micro in rank for row in micro) for rank in plan]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean else 1.0
