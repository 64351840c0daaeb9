"""The remote judge's rate limit and back-off on an injected clock (the client itself, against
a local server, is in tests/integration/rl/rewards/test_judge.py)."""

from __future__ import annotations

import asyncio

import pytest

from rl.rewards.judge_remote import MAX_RETRY_AFTER_S, RateLimiter, backoff_s


class FakeClock:
    """A clock that moves only when something sleeps on it (or the test sets it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_rate_limiter_spaces_starts_evenly() -> None:
    clock = FakeClock()
    limiter = RateLimiter(4.0, clock, clock.sleep)  # one start every 0.25 s
    # Three at once: the first now, the next two 0.25 and 0.5 s later.
    assert [limiter.delay() for _ in range(3)] == [0.0, 0.25, 0.5]
    clock.now += 10.0  # idle for a while: no credit builds up beyond the next start
    assert [limiter.delay() for _ in range(2)] == [0.0, 0.25]


def test_rate_limiter_sleeps_until_each_start() -> None:
    clock = FakeClock()
    limiter = RateLimiter(2.0, clock, clock.sleep)

    async def three() -> list[float]:
        starts = []
        for _ in range(3):
            await limiter.wait()
            starts.append(clock.now)
        return starts

    assert asyncio.run(three()) == [100.0, 100.5, 101.0]
    assert clock.slept == [0.5, 0.5]


def test_no_rate_limit_never_waits() -> None:
    clock = FakeClock()
    limiter = RateLimiter(0.0, clock, clock.sleep)
    assert [limiter.delay() for _ in range(5)] == [0.0] * 5


@pytest.mark.parametrize(
    ("retry", "retry_after", "expected"),
    [
        (0, None, 1.5),
        (1, None, 3.0),
        (3, None, 12.0),
        (0, 7.0, 7.0),  # the server's Retry-After wins
        (2, 0.0, 0.0),
        (0, -3.0, 0.0),
        (0, 1e6, MAX_RETRY_AFTER_S),
    ],
)
def test_backoff_doubles_from_its_base_unless_the_server_says(
    retry: int, retry_after: float | None, expected: float
) -> None:
    assert backoff_s(retry, 1.5, retry_after) == expected
