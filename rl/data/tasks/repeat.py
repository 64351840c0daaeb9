"""Repeat a short letter pattern n times, counting down: prompt "ab*3", answer "3ab2ab1ab".

A task whose answers have a heavy length tail, for the schedulers that must not wait on a
step's longest response (scheduler.partial_rollout abort and carry): counts are drawn
log-normal, so answers run from two characters (one token each under the CPU recipes'
byte-level tokenizer) to MAX_ANSWER, a median near a dozen. The countdown numbers each
repetition so that a tiny model learns where to stop from the last number it wrote, not by
counting its own output (plain repetitions left a 1M-parameter base at 0% after 150 SFT
steps). Scored by exact match with the reference.
"""

from __future__ import annotations

import math
import random
import string

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

MAX_PATTERN = 3  # pattern lengths are drawn from 1..MAX_PATTERN letters
MEDIAN_COUNT = 4  # median repetitions
SIGMA = 1.2  # log-normal shape: the 95th percentile is ~7x the median, the 99th ~16x
MAX_ANSWER = 320  # characters; longer draws are redrawn (not capped: no pile-up at the limit)


def answer_of(pattern: str, count: int) -> str:
    """The reference answer: `pattern` written `count` times, each after its number counted
    down to 1."""
    return "".join(f"{number}{pattern}" for number in range(count, 0, -1))


@TASKS.register("repeat")
class Repeat(Task):
    name = "repeat"

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        examples = []
        while len(examples) < num:
            count = max(1, round(rng.lognormvariate(math.log(MEDIAN_COUNT), SIGMA)))
            size = rng.randint(1, MAX_PATTERN)
            pattern = "".join(rng.choice(string.ascii_lowercase) for _ in range(size))
            if len(answer_of(pattern, count)) > MAX_ANSWER:
                continue
            examples.append(
                {
                    "prompt": f"{pattern}*{count}",
                    "answer": answer_of(pattern, count),
                    "pattern": pattern,
                    "count": count,
                }
            )
        return examples

    def score(self, response: str, example: dict) -> float:
        """Exact match (surrounding whitespace aside). An example whose fields disagree raises
        ValueError naming the field: a data bug must show up, not score 0 for every response."""
        pattern, count, answer = example.get("pattern"), example.get("count"), example.get("answer")
        if not isinstance(pattern, str) or not pattern or not pattern.isalpha():
            raise ValueError(f"repeat example: pattern must be a non-empty word, got {pattern!r}")
        if type(count) is not int or count < 1:
            raise ValueError(f"repeat example: count must be a positive integer, got {count!r}")
        if answer != answer_of(pattern, count):
            raise ValueError(
                f"repeat example: answer {answer!r} is not pattern {pattern!r} x {count}"
            )
        # Exact only: a prefix or a near-miss count would be reward-hackable.
        return 1.0 if response.strip() == answer else 0.0
