"""Math word problems (GSM8K- or MATH-style) read from files: the answer is checked by value.

There is nothing to generate: prompts and gold answers come from `data.train_files` and
`data.test_files` (jsonl or parquet with `prompt` and `answer` columns). Prompts should ask for
the final answer in `\\boxed{}`; math-verify extracts it and compares it with the gold answer.
"""

from __future__ import annotations

import random

from math_verify import parse, verify

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task


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
        """1.0 when the final answer in `response` equals `example["answer"]` mathematically.

        Both sides go through math-verify, so `\\boxed{1/2}` matches a gold `0.5` or
        `\\frac{1}{2}`. A gold answer math-verify cannot read raises: a data bug must show up
        as an error, not as a silent zero for every response.
        """
        answer = str(example["answer"])
        # Bare gold answers ("x^2+1", "\sqrt{2}") parse only inside a math environment.
        gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
        if not gold:
            raise ValueError(f"math-verify could not parse the gold answer {answer!r}")
        return 1.0 if verify(gold, parse(response)) else 0.0
