"""What the scheduler measures time by and waits on (`Clock`).

The driver runs the loop on the wall clock: futures that Ray's workers complete, and
`time.perf_counter`. A simulation (bench/simulate.py) hands the same loop a clock that jumps
from one simulated event to the next, so that the real scheduling code runs a cluster's
hours in seconds and never sleeps.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (any origin)."""
        ...

    def wait_first(self, futures: list[Future]) -> set[Future]:
        """Block until at least one of `futures` is done; returns those done."""
        ...


class WallClock:
    """Real time, and futures completed by other threads or processes."""

    def now(self) -> float:
        return time.perf_counter()

    def wait_first(self, futures: list[Future]) -> set[Future]:
        done, _ = wait(futures, return_when=FIRST_COMPLETED)
        return done


WALL_CLOCK = WallClock()
