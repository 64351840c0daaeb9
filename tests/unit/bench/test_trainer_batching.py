"""bench/trainer_batching.py: the positions each side computes and the table of ratios."""

from __future__ import annotations

from rl.config.recipe import load_config
from tests.unit.bench.bench_modules import load_bench_module

trainer_batching = load_bench_module("trainer_batching")


def test_positions_count_padding_per_micro_batch_or_packed_rows() -> None:
    cfg = load_config(
        trainer_batching.RECIPE, ["trainer.num_workers=1", "trainer.micro_batch_size=2"]
    )
    lengths = [10, 2, 3, 9]
    # in order: [10, 2] -> 2 x 10, [3, 9] -> 2 x 9
    assert trainer_batching.positions(lengths, cfg, packing=False, micro_batch_tokens=0) == 38
    # longest first within 20 positions: [10, 9] -> 20, [3, 2] -> 6
    assert trainer_batching.positions(lengths, cfg, packing=False, micro_batch_tokens=20) == 26
    # rows of 10: [10], [9], [3, 2] -> 3 rows of 10
    assert trainer_batching.positions(lengths, cfg, packing=True, micro_batch_tokens=20) == 30


def test_the_table_gives_each_side_against_padding() -> None:
    results = {
        "config": {"num_ranks": 2, "micro_batch_size": 32, "tokens": 4096},
        "real_tokens": 100,
        "positions": {"padded": 150, "budget": 120, "packed": 110},
        "runs": {
            "padded": {"tokens_per_s": 400.0},
            "budget": {"tokens_per_s": 500.0},
            "packed": {"tokens_per_s": 600.0},
        },
    }
    table = trainer_batching.table(results)
    assert "| 110 | 600 | 1.50x | >= 1.5x |" in table
    assert "| 120 | 500 | 1.25x |  |" in table
