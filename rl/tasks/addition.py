"""Addition of two n-digit numbers: prompt "123+456", answer "579"."""

from __future__ import annotations

import random

from rl.config import DataConfig
from rl.tasks import TASKS, Task


@TASKS.register("addition")
class Addition(Task):
    name = "addition"
    param_fields = ("num_digits",)

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        if cfg.num_digits < 1:
            raise ValueError(f"data.num_digits must be >= 1, got {cfg.num_digits}")
        # Exactly num_digits digits (no leading zeros), so prompts have a fixed shape.
        low, high = 10 ** (cfg.num_digits - 1), 10**cfg.num_digits - 1
        examples = []
        for _ in range(num):
            a, b = rng.randint(low, high), rng.randint(low, high)
            examples.append({"prompt": f"{a}+{b}", "answer": str(a + b)})
        return examples

    def score(self, response: str, example: dict) -> float:
        # Exact match only: partial credit or lenient parsing would be reward-hackable.
        return 1.0 if response.strip() == example["answer"] else 0.0
