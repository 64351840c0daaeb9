"""bench/rollout_engines.py: every registered engine is measured, and the table of ratios."""

from __future__ import annotations

import pytest

from rollout.engines.registry import ENGINES
from tests.unit.bench.bench_modules import load_bench_module

rollout_engines = load_bench_module("rollout_engines")


def test_the_table_gives_seconds_per_round_and_the_torch_to_vllm_ratio() -> None:
    runs = {
        "vllm": {"seconds": [0.2, 0.3], "tokens": [1000, 1000], "tokens_per_s": 4000.0},
        "torch": {"seconds": [0.1, 0.1], "tokens": [1000, 1000], "tokens_per_s": 10000.0},
    }
    table = rollout_engines.table({"workloads": {"tiny": runs}})
    assert "| tiny | 0.250 | 0.100 | 4,000 | 10,000 | 2.50x |" in table


def test_both_engines_are_registered_and_an_unknown_one_lists_them() -> None:
    assert ENGINES.names() == ["torch", "vllm"]
    with pytest.raises(ValueError, match="valid: torch, vllm"):
        ENGINES.get("sglang")
