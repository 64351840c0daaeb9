"""A rollout worker's OpenAI-compatible HTTP endpoint: `/v1/chat/completions`,
`/v1/completions` and `/v1/models`, on a Unix socket in a private directory, on the worker's
event loop.

Only HTTP lives here: each request's bearer key (one per episode) and JSON body go to the
`serve` callback (rollout.api_agent_loop), whose reply becomes the response. Its errors map to
the status codes the OpenAI SDKs know: `BadRequest` 400 (not retried), `Unknown` 401 (a key of
no live episode: the endpoint answers no one else), `Paused` 503 (the episode was paused for a
weight sync; its agent is stopped and runs again later, so the reply is never read).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rl.agents.openai_api import BadRequest

Serve = Callable[[str, str, object], Awaitable[dict[str, Any]]]  # (key, "chat"|"completion", body)


class Unknown(Exception):
    """No live episode has this key."""


class Paused(Exception):
    """The call's episode was paused (a weight sync); its agent is being stopped."""


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": None}}, status=status
    )


class Endpoint:
    def __init__(self, serve: Serve, model: str) -> None:
        self._serve, self.model = serve, model
        self._dir = tempfile.mkdtemp(prefix="tandem-endpoint-")
        self.socket = os.path.join(self._dir, "v1.sock")
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        await web.UnixSite(self._runner, self.socket).start()
        # A sandboxed agent runs as another uid (rl.isolation): it may cross the directory and
        # connect to the socket, not list or change the directory. Its key is what admits it.
        os.chmod(self._dir, 0o711)
        os.chmod(self.socket, 0o666)

    async def close(self) -> None:
        await self._runner.cleanup()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._handle(request, "chat")

    async def _completion(self, request: web.Request) -> web.Response:
        return await self._handle(request, "completion")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "tandem"}],
            }
        )

    async def _handle(self, request: web.Request, kind: str) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        try:
            return web.json_response(await self._serve(key, kind, body))
        except Unknown:
            return _error(401, "no live episode has this API key", "authentication_error")
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error")
        except Paused:
            return _error(503, "the episode was paused for a weight sync", "server_error")
