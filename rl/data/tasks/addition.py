"""Addition of two n-digit numbers: prompt "123+456", answer "0579" (or "579" unpadded).

Zero-padding (data.zero_pad) matters for tiny models learning from scratch: with plain
answers a sum's digit positions depend on whether it carries into a new digit, and a small
Qwen2 learns the 3-digit-sum and 4-digit-sum layouts as two separate skills, hundreds of SFT
steps apart, so an early-stopped base is right on one kind of sum and at chance on the other.
"""

from __future__ import annotations

import random

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task


@TASKS.register("addition")
class Addition(Task):
    name = "addition"
    param_fields = ("num_digits", "zero_pad")

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        if cfg.num_digits < 1:
            raise ValueError(f"data.num_digits must be >= 1, got {cfg.num_digits}")
        # Exactly num_digits digits (no leading zeros), so prompts have a fixed shape.
        low, high = 10 ** (cfg.num_digits - 1), 10**cfg.num_digits - 1
        width = cfg.num_digits + 1 if cfg.zero_pad else 0
        examples = []
        for _ in range(num):
            a, b = rng.randint(low, high), rng.randint(low, high)
            examples.append({"prompt": f"{a}+{b}", "answer": str(a + b).zfill(width)})
        return examples

    def score(self, response: str, example: dict) -> float:
        # Exact match only: partial credit or lenient parsing would be reward-hackable.
        return 1.0 if response.strip() == example["answer"] else 0.0
