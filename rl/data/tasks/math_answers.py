"""Math word problems (GSM8K- or MATH-style) read from files: the answer is checked by value.

There is nothing to generate: prompts and gold answers come from `data.train_files` and
`data.test_files` (jsonl or parquet with `prompt` and `answer` columns). Prompts should ask for
the final answer in `\\boxed{}`; math-verify extracts it and compares it with the gold answer.
"""

from __future__ import annotations

import random

from rl.config import DataConfig
from rl.data.tasks import TASKS, Task


@TASKS.register("math")
class MathAnswers(Task):
    name = "math"
    needs_files = True

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        raise ValueError(
            "task 'math' is read from files: set data.train_files and data.test_files "
            "(jsonl or parquet with prompt and answer columns)"
        )

    def score(self, response: str, example: dict) -> float:
        # Imported here: rl.rewards imports rl.data.tasks for its own task-backed verifiers.
        from rl.rewards.verifiers import math_answer

        return math_answer(response, example)
