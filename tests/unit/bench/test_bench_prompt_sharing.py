"""bench/prompt_sharing.py (named apart from the trainer's test_prompt_sharing.py): positions
come from the layouts the trainer builds, and the table of ratios."""

from __future__ import annotations

import torch

from rl.config import TrainerConfig
from rl.types import Batch
from tests.unit.bench.bench_modules import load_bench_module

prompt_sharing = load_bench_module("prompt_sharing")


def test_shared_prompts_compute_each_groups_prompt_once() -> None:
    """Two prompts of 3 tokens, each with responses of 2 and 1 tokens, padded to 5."""
    input_ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 6, 0], [7, 8, 9, 4, 5], [7, 8, 9, 6, 0]])
    attention_mask = (input_ids != 0).long()
    loss_mask = torch.zeros(4, 4)
    loss_mask[:, 2:] = attention_mask[:, 3:].float()
    zeros = torch.zeros(4, 4)
    batch = Batch(input_ids, attention_mask, loss_mask, zeros, zeros, zeros)
    cfg = TrainerConfig(num_workers=1)
    assert prompt_sharing.positions(batch, cfg, share_prompts=False) == 4 * 5
    assert prompt_sharing.positions(batch, cfg, share_prompts=True) == 2 * (3 + 2 + 1)


def test_the_table_gives_seconds_per_step_and_the_ratio_to_padded() -> None:
    run = {"seconds": [0.1, 0.1], "tokens": [1000, 1000]}
    results = {
        "real_tokens": 1000,
        "positions": {"padded": 2304, "shared": 960},
        "runs": {
            "padded": run | {"tokens_per_s": 10_000.0},
            "shared": run | {"seconds": [0.05, 0.05], "tokens_per_s": 20_000.0},
        },
    }
    rows = prompt_sharing.table(results).splitlines()
    assert rows[2] == "| padded | 2,304 | 10,000 | 0.100 | 1.00x |"
    assert rows[3] == "| shared | 960 | 20,000 | 0.050 | 2.00x |"
