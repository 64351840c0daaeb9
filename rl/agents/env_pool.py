"""Users' environments (`agent.environment: path/to/file.py:ClassName`) in sandboxed worker
processes (rl.agents.env_worker).

`sandboxed_environment(cfg)` is the class the rest of Tandem uses in place of the user's: the
same interface (rl.agents.environment), each method a request to a worker of this process's
`EnvPool` for that class. An instance holds the user's environment as the bytes of its
pickle, which only workers make and read; so an episode's sample carries it to any rollout
worker, as it carries a built-in environment, and the pool there starts at its first request.

A request that raises, replies with what does not fit the interface, outlives
`agent.env_timeout_s` or kills its worker is an `EnvFailure`; a worker that hung or died is
replaced, and where that fails, the next request that would have used it starts one again
(an `EnvFailure` too where that fails). An episode whose step fails ends there
(rl.agents.episode counts it); a reset or a demonstration that fails stops the run with the
environment named.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from rl.agents.environment import Environment, EnvStep, Message
from rl.config import AgentConfig
from rl.sandbox import STARTUP_TIMEOUT_S, WorkerProcess, clean_env, start_worker, stop_workers
from rl.user_code import parse_file_ref

MAX_MESSAGE_BYTES = 64 << 20  # a reply, or an environment's pickled state
ROLES = ("system", "user", "assistant", "tool")


class EnvFailure(RuntimeError):
    """A request to a user's environment failed. `kind`: "error" (the environment raised or
    replied with what does not fit the interface; its worker is fine), "timeout" or "crash"
    (its worker hung or died, or sent what is not a reply, and was replaced), "unavailable"
    (a worker that died could not be replaced, nor started again for this request)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple:
        return EnvFailure, (self.kind, str(self))


@dataclass(frozen=True)
class EnvSettings:
    """Which environment class and under which limits: one `EnvPool` per value."""

    ref: str  # "/absolute/path/file.py:ClassName"
    num_workers: int
    timeout_s: float
    memory_mb: int

    @classmethod
    def of(cls, cfg: AgentConfig) -> EnvSettings:
        parsed = parse_file_ref(cfg.environment, f"agent.environment {cfg.environment!r}")
        assert parsed is not None, f"not a user's environment: {cfg.environment!r}"
        path, name = parsed
        ref = f"{os.path.abspath(path)}:{name}"
        return cls(ref, cfg.env_workers, cfg.env_timeout_s, cfg.env_memory_mb)


class EnvPool:
    """`settings.num_workers` workers serving requests for one environment class, one request
    per worker at a time; `request` is thread-safe and blocks until a worker is free. The
    workers run in sandboxes (rl.sandbox) with a clean environment and an address-space limit
    of `settings.memory_mb` MiB; their output goes to `log_file` (None: this process's
    stderr). `tools` is the class's `tools`, as a worker read it."""

    def __init__(self, settings: EnvSettings, log_file: str | None = None) -> None:
        self.settings = settings
        self._log_file = log_file
        self._env = clean_env(())
        # Idle workers; None in place of one that could not be replaced (the request that
        # takes it tries to start one again).
        self._idle: queue.SimpleQueue[WorkerProcess | None] = queue.SimpleQueue()
        self._workers: list[WorkerProcess] = []
        self._lock = threading.Lock()  # guards _workers and _closed
        self._closed = False
        self.tools: tuple[str, ...] = ()
        self._what = _what(settings)
        try:
            for _ in range(settings.num_workers):
                self._idle.put(self._start())
        except BaseException:
            self.close()
            raise

    def request(self, request: dict, state: bytes | None) -> tuple[dict, bytes | None]:
        """Send `request` (JSON) and the environment's `state`; the reply and the new state.
        EnvFailure when the environment raised, its worker timed out or died, or no worker
        could be started for it."""
        try:
            payload = json.dumps({**request, "has_state": state is not None}).encode()
        except (TypeError, ValueError) as e:  # a data example holding what JSON cannot
            raise ValueError(f"{self._what}: the request is not JSON: {e}") from None
        worker = self._idle.get()
        if worker is None:  # a worker that died could not be replaced: try again for this one
            try:
                worker = self._start()
            except Exception as e:
                self._idle.put(None)
                raise EnvFailure(
                    "unavailable", f"{self._what}: a worker could not be started again ({e})"
                ) from e
        try:
            result = self._exchange(worker, payload, state)
        except (EOFError, OSError, ValueError) as e:
            failure = EnvFailure("crash", f"{self._what}: its worker died or sent junk ({e!r})")
        except EnvFailure as e:
            failure = e
        except BaseException:  # interrupted mid-request: the worker may still be busy
            self._retire(worker)
            raise
        else:
            self._idle.put(worker)
            return result
        if failure.kind == "error":
            self._idle.put(worker)
        else:
            self._retire(worker)
        raise failure

    def close(self) -> None:
        """Stop the workers; requests in flight fail."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        stop_workers(workers)

    def _exchange(
        self, worker: WorkerProcess, payload: bytes, state: bytes | None
    ) -> tuple[dict, bytes | None]:
        worker.conn.send_bytes(payload)
        if state is not None:
            worker.conn.send_bytes(state)
        reply = self._receive(worker)
        if "error" in reply:
            raise EnvFailure("error", f"{self._what}: {reply['error']}")
        new_state = None
        if reply.get("has_state") is True:
            new_state = self._receive(worker, state=True)
        return reply, new_state

    def _receive(self, worker: WorkerProcess, state: bool = False) -> Any:
        if not worker.conn.poll(self.settings.timeout_s):
            raise EnvFailure(
                "timeout",
                f"{self._what}: no reply within agent.env_timeout_s={self.settings.timeout_s:g} s",
            )
        data = worker.conn.recv_bytes(MAX_MESSAGE_BYTES)
        if state:
            return data
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError(f"a reply that is a {type(reply).__name__}, not an object")
        return reply

    def _start(self) -> WorkerProcess:
        """A new worker, once it has loaded the class (its `tools` recorded)."""
        path = self.settings.ref.rpartition(":")[0]
        worker = start_worker(
            "rl.agents.env_worker", self._env, self.settings.memory_mb, self._log_file, [path]
        )
        with self._lock:
            if self._closed:
                worker.kill()
                raise EnvFailure("closed", "the environment pool is closed")
            self._workers.append(worker)
        try:
            self.tools = self._load(worker)
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _load(self, worker: WorkerProcess) -> tuple[str, ...]:
        """Have `worker` load the class; its `tools`."""
        what = self._what
        worker.conn.send_bytes(json.dumps({"ref": self.settings.ref}).encode())
        if not worker.conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"{what}: its worker did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            ready = json.loads(worker.conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError, ValueError) as e:
            raise RuntimeError(
                f"{what}: its worker died or sent junk while starting ({e!r})"
            ) from None
        if not isinstance(ready, dict):
            raise RuntimeError(f"{what}: its worker sent {str(ready)[:200]!r} while starting")
        if "failed" in ready:
            raise ValueError(f"{what} cannot be loaded: {ready['failed']}")
        tools = ready.get("tools")
        if not (isinstance(tools, list) and all(isinstance(t, str) for t in tools)):
            raise RuntimeError(f"{what}: its worker sent malformed tools {tools!r}")
        return tuple(tools)

    def _discard(self, worker: WorkerProcess) -> None:
        worker.kill()
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)

    def _retire(self, worker: WorkerProcess) -> None:
        """Kill `worker` and put a fresh one in its place (None, for the next request to try
        again, when none starts; nothing once the pool is closed)."""
        self._discard(worker)
        with self._lock:
            if self._closed:
                return
        try:
            self._idle.put(self._start())
        except BaseException:
            self._idle.put(None)


# This process's pools, one per settings: started by the first class (the driver) or request
# (a rollout worker) that needs it, stopped by `close_env_pools` or at the process's exit.
_POOLS: dict[EnvSettings, EnvPool] = {}
_POOLS_LOCK = threading.Lock()
_CLASSES: dict[EnvSettings, type[SandboxedEnvironment]] = {}


def env_pool(settings: EnvSettings) -> EnvPool:
    """This process's pool for `settings`, started on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(settings)
        if pool is None:
            pool = _POOLS[settings] = EnvPool(settings)
        return pool


def close_env_pools() -> None:
    """Stop this process's environment workers (before it exits, or in a test)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


class SandboxedEnvironment(Environment):
    """A user's environment, run by `EnvPool` workers (the module's docstring). Subclassed per
    environment by `sandboxed_environment`, which sets `settings` and `tools`."""

    settings: ClassVar[EnvSettings]

    def __init__(self, state: bytes | None = None) -> None:
        self._state = state  # the user's object, pickled by a worker; None before reset

    def reset(self, example: dict) -> list[Message]:
        reply, self._state = self._request({"op": "reset", "example": example})
        return _messages(reply.get("messages"), "reset", self.settings)

    def step(self, turn: str, tool_messages: list[Message]) -> EnvStep:
        assert self._state is not None, "step before reset"
        request = {"op": "step", "turn": turn, "tool_messages": tool_messages}
        reply, self._state = self._request(request)
        reward, done = reply.get("reward"), reply.get("done")
        if not (isinstance(reward, int | float) and math.isfinite(reward)):
            raise EnvFailure(
                "error", f"{_what(self.settings)}: step's reward {reward!r} is not a finite number"
            )
        if not isinstance(done, bool):
            raise EnvFailure("error", f"{_what(self.settings)}: step's done {done!r} is not a bool")
        return EnvStep(_messages(reply.get("messages"), "step", self.settings), float(reward), done)

    def demonstration(self, example: dict) -> list[Message] | None:
        reply, _ = self._request({"op": "demonstration", "example": example})
        messages = reply.get("messages")
        return None if messages is None else _messages(messages, "demonstration", self.settings)

    def _request(self, request: dict) -> tuple[dict, bytes | None]:
        return env_pool(self.settings).request(request, self._state)

    def __reduce__(self) -> tuple:
        # The class is made at run time: rebuilt by value wherever the sample goes.
        return _restore, (self.settings, self.tools, self._state)


def sandboxed_environment(cfg: AgentConfig) -> type[SandboxedEnvironment]:
    """The class standing for `cfg.environment` (a user's `path/to/file.py:ClassName`). Starts
    this process's pool for it, so that an environment that cannot be loaded fails here, and
    its `tools` are known."""
    settings = EnvSettings.of(cfg)
    return _class(settings, env_pool(settings).tools)


def _class(settings: EnvSettings, tools: tuple[str, ...]) -> type[SandboxedEnvironment]:
    with _POOLS_LOCK:
        cls = _CLASSES.get(settings)
        if cls is None:
            name = settings.ref.rpartition(":")[2]
            attributes = {"settings": settings, "tools": tools, "__module__": __name__}
            cls = _CLASSES[settings] = type(name, (SandboxedEnvironment,), attributes)
        return cls


def _restore(
    settings: EnvSettings, tools: tuple[str, ...], state: bytes | None
) -> SandboxedEnvironment:
    return _class(settings, tools)(state)


def _what(settings: EnvSettings) -> str:
    return f"agent.environment {settings.ref!r}"


def _messages(messages: object, method: str, settings: EnvSettings) -> list[Message]:
    """`messages` if they are chat messages: objects with a role of `ROLES` and string values."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict)
        and m.get("role") in ROLES
        and isinstance(m.get("content"), str)
        and all(isinstance(v, str) for v in m.values())
        for m in messages
    ):
        raise EnvFailure(
            "error",
            f"{_what(settings)}: {method} returned {str(messages)[:200]!r}, not a list of chat "
            f"messages (dicts of strings with a 'content' and a 'role' of {', '.join(ROLES)})",
        )
    return messages
