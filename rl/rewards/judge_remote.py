"""A judge behind an OpenAI-compatible chat-completions endpoint (`judge.url`).

Requests run on an event loop of their own, in a thread of the driver, so the reward thread
only waits for their results: at most `max_concurrency` in flight, started no faster than
`requests_per_s`, each within `timeout_s`. A request that times out, cannot connect, or gets
a 429 or a 5xx is retried `max_retries` times, after `backoff_s`, then twice as long each
time, or after what the server's Retry-After asks. Other answers (401, 400, a body that is not
a chat completion) fail at once: retrying would not help.

The API key is read from the environment variable `api_key_env` names when the judge starts,
sent only in the Authorization header, and kept out of every message this module makes (a
server that echoes it back has it replaced by `***`); configs and checkpoints hold only the
variable's name.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable

import aiohttp

from rl.config.tree import JudgeConfig

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 300.0  # a server asking for longer is waited for this long at most
ERROR_BODY_CHARS = 300  # of an error response's body, quoted in its message

Reply = tuple[str | None, str]  # (the judge's text, or None and why it failed)
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class RateLimiter:
    """Starts at most `rate` requests a second, evenly spaced (0 = no limit): each `wait`
    takes the next free start time and sleeps until it."""

    def __init__(self, rate: float, clock: Clock, sleep: Sleep) -> None:
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._clock, self._sleep = clock, sleep
        self._next = -float("inf")

    def delay(self) -> float:
        """Reserve the next start and return how long to wait for it."""
        now = self._clock()
        start = max(now, self._next)
        self._next = start + self._interval
        return start - now

    async def wait(self) -> None:
        delay = self.delay()
        if delay > 0:
            await self._sleep(delay)


def backoff_s(retry: int, base: float, retry_after: float | None) -> float:
    """The wait before retry number `retry` (0-based): what the server's Retry-After asked (at
    most MAX_RETRY_AFTER_S), else base * 2**retry."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), MAX_RETRY_AFTER_S)
    return base * 2.0**retry


def _retry_after(headers: object) -> float | None:
    """Retry-After in seconds when the server gave it as a number (an HTTP date is ignored)."""
    value = headers.get("Retry-After") if headers is not None else None  # type: ignore[attr-defined]
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class _Retry(Exception):
    """A failure worth retrying, and the wait the server asked for."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RemoteJudge:
    """Sends rendered judge inputs to `judge.url`, each as a single user message. `config_key` names the
    judge in messages (`reward.terms[1].judge`); `clock` and `sleep` drive the rate limit and
    the back-off (tests inject their own)."""

    def __init__(
        self,
        judge: JudgeConfig,
        config_key: str,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._judge = judge
        self._where = f"judge at {judge.url}"
        self._endpoint = judge.url.rstrip("/") + "/chat/completions"
        self._api_key = os.environ[judge.api_key_env] if judge.api_key_env else ""
        self._config_key = config_key  # reward.terms[i].judge, for messages
        self._clock, self._sleep = clock, sleep
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="judge-http", daemon=True
        )
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._limiter = RateLimiter(judge.requests_per_s, clock, sleep)
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:  # never the key
        return f"RemoteJudge({self._judge.url!r}, model={self._judge.model!r})"

    def submit(self, texts: list[str]) -> Callable[[], tuple[list[Reply], int, int]]:
        """Start judging `texts`; returns a call that waits for (one Reply per text, failed
        tries that were retried, 0: no actor to lose)."""
        future = asyncio.run_coroutine_threadsafe(self._judge_all(texts), self._loop)

        def wait() -> tuple[list[Reply], int, int]:
            replies, retried = future.result()
            return replies, retried, 0

        return wait

    async def _judge_all(self, texts: list[str]) -> tuple[list[Reply], int]:
        if self._session is None:  # made on the loop it is used on
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._session = aiohttp.ClientSession(headers=headers)
            self._slots = asyncio.Semaphore(self._judge.max_concurrency)
        results = await asyncio.gather(*(self._one(text) for text in texts))
        return [reply for reply, _ in results], sum(retries for _, retries in results)

    async def _one(self, text: str) -> tuple[Reply, int]:
        """(reply, how many failed tries were retried) for one input."""
        assert self._slots is not None
        judge = self._judge
        retry = 0
        async with self._slots:
            while True:
                await self._limiter.wait()
                try:
                    return (await self._request(text), ""), retry
                except _Retry as failure:
                    if retry >= judge.max_retries:
                        tries = f"{retry + 1} tr{'ies' if retry else 'y'}"
                        return (None, self._scrub(f"{failure} (after {tries})")), retry
                    await self._sleep(backoff_s(retry, judge.backoff_s, failure.retry_after))
                    retry += 1
                except _Fatal as failure:
                    return (None, self._scrub(str(failure))), retry

    async def _request(self, text: str) -> str:
        assert self._session is not None
        judge = self._judge
        body = {
            "model": judge.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": judge.max_new_tokens,
            "temperature": judge.temperature,
        }
        timeout = aiohttp.ClientTimeout(total=judge.timeout_s)
        try:
            async with self._session.post(self._endpoint, json=body, timeout=timeout) as response:
                raw = await response.text()
                if response.status in RETRY_STATUSES:
                    raise _Retry(
                        f"{self._where}: HTTP {response.status}: {raw[:ERROR_BODY_CHARS]!r}",
                        _retry_after(response.headers),
                    )
                if response.status != 200:
                    raise _Fatal(
                        f"{self._where}: HTTP {response.status}: {raw[:ERROR_BODY_CHARS]!r}"
                    )
        except asyncio.TimeoutError:
            raise _Retry(
                f"{self._where}: no answer within {self._config_key}.timeout_s="
                f"{judge.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            # The exception's text only: its request_info would carry the request's headers.
            raise _Retry(f"{self._where}: {type(exc).__name__}: {exc}") from None
        return self._content(raw)

    def _content(self, raw: str) -> str:
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise _Fatal(
                f"{self._where}: not a chat completion (no choices[0].message.content string): "
                f"{raw[:ERROR_BODY_CHARS]!r}"
            )
        return content

    def _scrub(self, message: str) -> str:
        return message.replace(self._api_key, "***") if self._api_key else message

    def close(self) -> None:
        """Close the HTTP session and stop the loop's thread."""
        if self._thread.is_alive():
            if self._session is not None:
                asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


class _Fatal(Exception):
    """A failure that a retry would not fix."""
