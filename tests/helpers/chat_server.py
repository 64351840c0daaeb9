"""A local OpenAI-compatible chat-completions server for the remote-judge tests: answers each
request with `answer(user message)`, checks the bearer key, and fails on demand (an HTTP
status, with a Retry-After for 429, or a hang past the client's timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

HANG_S = 30.0  # a "hang" answers after this long: past any test's timeout_s


@dataclass
class Seen:
    """What the server received."""

    authorizations: list[str | None] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


class ChatServer:
    """`with ChatServer(answer, key) as server:` serves on 127.0.0.1 at `server.url` (the
    base URL, .../v1). `fail_next(503, 429, "hang", ...)`: the next requests fail that way,
    in order. `delay_s`: each answer waits this long (to see concurrency)."""

    def __init__(self, answer: Callable[[str], str], key: str | None, delay_s: float = 0.0) -> None:
        self.answer, self.key, self.delay_s = answer, key, delay_s
        self.seen = Seen()
        self._failures: list[int | str] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def fail_next(self, *modes: int | str) -> None:
        with self._lock:
            self._failures.extend(modes)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.authorizations.append(request.headers.get("Authorization"))
        self.seen.bodies.append(body)
        with self._lock:
            mode = self._failures.pop(0) if self._failures else None
        if mode == "hang":  # until the client gives up (or the server closes)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), HANG_S)
        if mode == 429:
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0.01"})
        if isinstance(mode, int):
            # A careless server that echoes the request's credentials into its error.
            echo = request.headers.get("Authorization", "")
            return web.Response(status=mode, text=f"failed for {echo}")
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.Response(status=401, text="bad key")
        self.seen.in_flight += 1
        self.seen.max_in_flight = max(self.seen.max_in_flight, self.seen.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.seen.in_flight -= 1
        content = self.answer(body["messages"][-1]["content"])
        return web.json_response(
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    async def _start(self) -> int:
        self._closing = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return self._runner.addresses[0][1]

    def __enter__(self) -> ChatServer:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        self._loop.call_soon_threadsafe(self._closing.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
