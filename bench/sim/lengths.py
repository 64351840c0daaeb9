"""Response lengths: drawn from a long-tailed distribution, or replayed from a trace.

A sample's length is fixed by its ids (group, index), as a seeded engine's would be, so that
every placement and staleness bound of a sweep generates the same responses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from rl.types import Sample


def uniform(group_id: int, index: int, draw: int) -> float:
    """Draw `draw` (< 16) of sample (group_id, index), in (0, 1): splitmix64 of the three,
    as a seeded generator per sample costs more than the rest of the simulation of it."""
    z = ((group_id << 20 | index << 4 | draw) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (((z ^ (z >> 31)) >> 11) + 0.5) / 2**53


@functools.lru_cache(maxsize=1 << 16)
def _normal(group_id: int, index: int) -> float:
    """A standard normal draw per sample (Box-Muller; cached: a sample is asked again when
    it resumes)."""
    radius = math.sqrt(-2 * math.log(uniform(group_id, index, 0)))
    return radius * math.cos(2 * math.pi * uniform(group_id, index, 1))


@dataclass(frozen=True)
class LogNormal:
    """Lengths whose logarithm is normal: `median` tokens, spread `sigma`, cut at `cap` (the
    run's max_new_tokens: a sample that reaches it stops there, truncated)."""

    median: int
    sigma: float
    cap: int

    def __call__(self, sample: Sample) -> int:
        z = _normal(sample.group_id, sample.index)
        return max(1, min(self.cap, round(self.median * math.exp(self.sigma * z))))

    def mean(self) -> float:
        """The uncut mean (exp(sigma^2 / 2) x median); the cut makes the real one smaller."""
        return self.median * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class Replay:
    """Lengths from a trace, cycled: sample (group, index) takes entry
    (group x group_size + index) mod len(lengths)."""

    lengths: tuple[int, ...]
    group_size: int
    cap: int

    def __call__(self, sample: Sample) -> int:
        entry = sample.group_id * self.group_size + sample.index
        return min(self.cap, self.lengths[entry % len(self.lengths)])


def read_lengths(path: Path) -> tuple[int, ...]:
    """A trace of response lengths: one positive integer a line (blank lines and lines from
    `#` on are skipped). A file a user hands us, so every line is checked and a bad one named."""
    lengths = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not (text.isascii() and text.isdigit()) or int(text) < 1:
                raise ValueError(f"{path}:{number}: expected a positive token count, got {text!r}")
            lengths.append(int(text))
    if not lengths:
        raise ValueError(f"{path}: no response lengths in it")
    return tuple(lengths)
