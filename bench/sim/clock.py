"""Simulated seconds, for the real scheduler's `Clock` port (rl.run.scheduler.clock)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import Future


class SimClock:
    """`at(when, action)` runs `action` once the clock reaches `when`; `wait_first` runs the
    actions in time order until one of the awaited futures is done.

    The simulated workers complete futures only through `resolve` and `done`, which note
    them, so that a wait looks at what completed rather than asking each of its futures: a
    cluster of hundreds of engines has hundreds of futures outstanding and many events
    between two completions."""

    def __init__(self) -> None:
        self.time = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled
        self._completed: set[Future] = set()  # completed and not yet handed to a wait

    def now(self) -> float:
        return self.time

    def at(self, when: float, action: Callable[[], None]) -> None:
        assert when >= self.time - 1e-9, (when, self.time)
        heapq.heappush(self._events, (max(when, self.time), next(self._order), action))

    def resolve(self, future: Future, result: object) -> None:
        future.set_result(result)
        self._completed.add(future)

    def done(self, result: object) -> Future:
        """A future already completed (work that costs no simulated time)."""
        future: Future = Future()
        self.resolve(future, result)
        return future

    def wait_first(self, futures: list[Future]) -> set[Future]:
        awaited = set(futures)
        while not (done := self._completed & awaited):
            assert self._events, "waiting on futures nothing will complete"
            self.time, _, action = heapq.heappop(self._events)
            action()
        self._completed -= done
        return done

    def advance(self, seconds: float) -> None:
        """A blocking call of `seconds` (a weight sync, moving memory): every event due
        meanwhile runs first, at its own time."""
        end = self.time + seconds
        while self._events and self._events[0][0] <= end:
            self.time, _, action = heapq.heappop(self._events)
            action()
        self.time = end
