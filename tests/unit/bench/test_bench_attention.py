"""bench/attention.py (named apart from kernels' test_attention.py): both paths are timed on
a case, and the table names the one used."""

from __future__ import annotations

import torch

from kernels.attention import MAX_EXPLICIT_KEYS
from tests.unit.bench.bench_modules import load_bench_module

attention_bench = load_bench_module("attention")


def test_a_case_times_both_paths_forward_and_backward() -> None:
    case = attention_bench.Case("small", 2, 4, 3, 5, 8, True)
    ms = attention_bench.time_case(case, torch.bfloat16, rounds=1)
    assert set(ms) == {"sdpa", "explicit"} and all(value > 0 for value in ms.values())


def test_the_table_gives_the_ratio_and_which_path_each_case_runs() -> None:
    short = attention_bench.Case("short", 8, 4, 18, 18, 32, True)
    long = attention_bench.Case("long", 1, 4, 1, MAX_EXPLICIT_KEYS + 1, 32, False)
    results = [
        {"case": list(short), "dtype": "bfloat16", "sdpa": 6.0, "explicit": 2.0},
        {"case": list(short), "dtype": "float32", "sdpa": 1.0, "explicit": 2.0},
        {"case": list(long), "dtype": "bfloat16", "sdpa": 1.0, "explicit": 4.0},
    ]
    rows = attention_bench.table(results).splitlines()[2:]
    assert rows[0].endswith("| fwd + bwd | 6.00 | 2.00 | 3.00x | explicit |")
    assert rows[1].endswith("| 0.50x | SDPA |")
    assert rows[2].endswith("| fwd | 1.00 | 4.00 | 0.25x | SDPA |")
