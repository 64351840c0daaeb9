"""bench/delta_sync.py's counts of what changed between two versions on the wire."""

from __future__ import annotations

import torch

from tests.unit.bench.bench_modules import load_bench_module

delta_sync = load_bench_module("delta_sync")


def test_a_change_below_bf16_precision_is_no_change_on_the_wire() -> None:
    before = {"w": torch.ones(4, 3), "b": torch.zeros(5)}
    after = {"w": torch.ones(4, 3), "b": torch.zeros(5)}
    after["w"][1, 2] = 1.0 + 2**-10  # rounds back to 1.0 in bf16 (8 bits of mantissa)
    after["w"][3, 0] = 1.0 + 2**-6  # survives the rounding
    after["b"][4] = 1.0
    counts = delta_sync.changes(before, after)
    assert counts["elements"] == 17 and counts["changed"] == 2
    assert counts["rows"] == 5 and counts["changed_rows"] == 2  # w's row 3, b as one row
    assert counts["blocks"] == 2 and counts["changed_blocks"] == 2  # one block per tensor


def test_sync_bytes_count_an_index_with_each_element_or_row_sent() -> None:
    counts = {"elements": 100, "changed": 10, "rows": 10, "changed_rows": 2}
    assert delta_sync.sync_bytes(counts) == {
        "full": 200.0,
        "elements": 60.0,  # 10 x (2 bytes + 4 of index)
        "rows": 48.0,  # 2 x (10 x 2 bytes + 4)
    }
