"""Which letter a long string holds more of: prompt "abbab...a", answer "a" or "b".

A long-context task with a one-token answer, for the recipes that train on samples of thousands
of tokens (trainer.sequence_parallel): every letter of the prompt counts, so a model must read
all of it, while generating the answer takes one step. Lengths are drawn uniformly from
data.task_config's min_length..max_length letters (one token each under the CPU recipes'
byte-level tokenizer), odd ones only, so that there is no tie; each letter is an "a" with a probability
drawn uniformly from 0.5 +- SPREAD, so that some prompts are close calls. Scored by exact match.
"""

from __future__ import annotations

import random

from rl.config import DataConfig
from rl.data.tasks.task import TASKS, Task

LETTERS = "ab"
SPREAD = 0.1  # the share of a's is drawn from 0.4..0.6
# data.task_config keys -> default: the prompt's length in letters, both ends included.
LENGTHS = {"min_length": 63, "max_length": 255}


def majority_of(letters: str) -> str:
    """The letter `letters` holds more of (an odd-length string of LETTERS)."""
    return LETTERS[0] if 2 * letters.count(LETTERS[0]) > len(letters) else LETTERS[1]


def odd_lengths(cfg: DataConfig) -> range:
    """The odd lengths from data.task_config's min_length to its max_length (defaults where
    unset)."""
    lengths = {**LENGTHS, **cfg.task_config}
    return range(lengths["min_length"] | 1, lengths["max_length"] + 1, 2)


@TASKS.register("majority")
class Majority(Task):
    name = "majority"
    param_fields = ("task_config",)

    def check(self, cfg: DataConfig) -> None:
        """data.task_config holds min_length and max_length only, integers >= 1 with an odd
        number between them."""
        for key in cfg.task_config:
            if key not in LENGTHS:
                raise ValueError(
                    f"data.task_config: unknown key {key!r} for data.task=majority; valid: "
                    f"{', '.join(LENGTHS)}"
                )
        lengths = {**LENGTHS, **cfg.task_config}
        low, high = lengths["min_length"], lengths["max_length"]
        if not all(type(n) is int and n >= 1 for n in (low, high)) or not odd_lengths(cfg):
            raise ValueError(
                f"data.task_config: min_length={low!r} and max_length={high!r} must be "
                "integers >= 1 with an odd number from one to the other (prompts have no tie)"
            )

    def generate(self, cfg: DataConfig, num: int, rng: random.Random) -> list[dict]:
        lengths = odd_lengths(cfg)
        examples = []
        for _ in range(num):
            length = rng.choice(lengths)
            share = rng.uniform(0.5 - SPREAD, 0.5 + SPREAD)
            letters = "".join(LETTERS[rng.random() >= share] for _ in range(length))
            examples.append({"prompt": letters, "answer": majority_of(letters)})
        return examples

    def score(self, response: str, example: dict) -> float:
        """Exact match (surrounding whitespace aside). An example whose fields disagree raises
        ValueError naming the field: a data bug must show up, not score 0 for every response."""
        prompt, answer = example.get("prompt"), example.get("answer")
        if not isinstance(prompt, str) or len(prompt) % 2 == 0 or set(prompt) - set(LETTERS):
            raise ValueError(
                f"majority example: prompt must be an odd number of letters from {LETTERS!r}"
            )
        if answer != majority_of(prompt):
            raise ValueError(
                f"majority example: answer {answer!r} is not the prompt's majority letter"
            )
        return 1.0 if response.strip() == answer else 0.0
