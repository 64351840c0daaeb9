"""Tool calls in sandboxed worker processes, many in flight at once.

`ToolPool.submit` returns a future at once; a thread of the pool hands queued calls to idle
workers (rl.agents.tool_worker, started by rl.sandbox) and completes the futures, so one
trajectory waiting on a slow tool never holds up another. Every failure of a call (it raised,
hung, crashed, ran out of memory or CPU time, printed too much, returned junk, was called with
bad arguments or by an unknown name) is a `ToolResult` with an error kind for the model to
observe, never an exception in the caller. A worker enforces the call's limits itself; a
worker that misses the timeout by `WORKER_GRACE_S` anyway, or dies, is killed and replaced.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from typing import Literal

from rl.agents.resolve import agent_tools
from rl.agents.tool_worker import Settings
from rl.agents.tools import check_arguments, check_schema, resolve_tool
from rl.config import AgentConfig
from rl.isolation import Isolation
from rl.sandbox import STARTUP_TIMEOUT_S, WorkerProcess, clean_env, start_worker, stop_workers

ErrorKind = Literal["timeout", "crash", "memory", "error", "bad_arguments", "unknown_tool"]
WORKER_GRACE_S = 10.0  # past a call's timeout, how long its worker has to report it


@dataclass(frozen=True)
class ToolResult:
    """A call's observation. `output`: what the tool printed (stdout and stderr), then its
    return value as text or a description of what went wrong, at most `max_output_chars`
    characters and a "[truncated: N more characters]" line. `error`: None, or the kind of
    failure (docs/agents.md). `seconds`: from when a worker took the call to its result (0 for
    a call refused before any worker saw it)."""

    output: str
    error: ErrorKind | None
    seconds: float


@dataclass
class _Call:
    payload: bytes  # the JSON message for the worker
    future: Future[ToolResult]


@dataclass
class _Worker:
    proc: WorkerProcess
    ready: bool = False
    call: _Call | None = None
    busy_since: float = 0.0


class ToolPool:
    """`num_workers` worker processes running calls of `tools`: built-in names ("python"),
    users' "path/to/file.py:function" or functions defined at the top level of importable
    modules.

    Each call runs in a fresh process of a sandboxed worker (rl.sandbox; `isolation` says what
    the sandbox got) with a wall-clock limit of `timeout_s`, a CPU-time limit of `cpu_s`, an
    address-space limit of `memory_mb` MiB (0: none), an empty working directory removed
    afterwards, an environment with only `rl.sandbox.BASE_ENV` and `inherit_env` of the
    driver's, and its output cut to `max_output_chars`. The workers' own messages
    go to `log_file` (None: the driver's stderr). `schemas` are the tools' function schemas,
    for the chat template. Futures' callbacks run on the pool's thread: keep them short.
    """

    def __init__(
        self,
        tools: Sequence[str | Callable],
        num_workers: int = 4,
        timeout_s: float = 30.0,
        cpu_s: float = 30.0,
        memory_mb: int = 1024,
        max_output_chars: int = 10_000,
        inherit_env: Sequence[str] = (),
        log_file: str | None = None,
    ) -> None:
        for key, value, low in (
            ("num_workers", num_workers, 1),
            ("timeout_s", timeout_s, 1e-3),
            ("cpu_s", cpu_s, 1),  # RLIMIT_CPU counts whole seconds
            ("memory_mb", memory_mb, 0),
            ("max_output_chars", max_output_chars, 1),
        ):
            if not value >= low:
                raise ValueError(f"{key} must be >= {low:g}, got {value}")
        specs = [resolve_tool(tool) for tool in tools]
        names = [spec.name for spec in specs]
        if len(set(names)) < len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"tools named twice: {', '.join(twice)}")
        # name -> function schema; users' files' schemas arrive with the workers' "ready".
        self._schemas: dict[str, dict | None] = {spec.name: spec.schema for spec in specs}
        self.isolation = Isolation()  # what the workers report as they start
        self._timeout_s = timeout_s
        self._memory_mb = memory_mb
        self._log_file = log_file
        self._env = clean_env(inherit_env, python_path=[spec.root for spec in specs])
        self._read_paths = [spec.spec.rpartition(":")[0] for spec in specs if not spec.root]
        settings = Settings(
            {spec.name: spec.spec for spec in specs},
            [spec.name for spec in specs if spec.schema is None],
            timeout_s,
            cpu_s,
            memory_mb,
            max_output_chars,
        )
        self._settings = json.dumps(asdict(settings)).encode()
        # The longest message a worker sends: the output, every character JSON-escaped.
        self._max_message = 12 * max_output_chars + 4096
        self._lock = threading.Lock()  # guards _pending, _closed, _failure
        self._pending: deque[_Call] = deque()
        self._closed = False
        self._failure: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()  # submit() and close() wake the thread
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._workers: list[_Worker] = []
        try:
            for _ in range(num_workers):
                self._workers.append(self._start())
            # Wait here, so that a tool that cannot be imported fails before any call.
            while not all(w.ready for w in self._workers):
                self._step()
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="tool-pool", daemon=True)
        self._thread.start()

    @property
    def schemas(self) -> list[dict]:
        """The tools' function schemas, in order, for the chat template."""
        return list(self._schemas.values())

    @classmethod
    def for_agent(cls, cfg: AgentConfig, log_file: str | None = None) -> ToolPool:
        """The pool of an agent set-up: its tools (rl.agents.resolve.agent_tools) under its
        `agent.tool_*` limits."""
        return cls(
            agent_tools(cfg),
            num_workers=cfg.tool_workers,
            timeout_s=cfg.tool_timeout_s,
            cpu_s=cfg.tool_cpu_s,
            memory_mb=cfg.tool_memory_mb,
            log_file=log_file,
        )

    def submit(self, name: str, arguments: dict) -> Future[ToolResult]:
        """Queue a call of tool `name`; its future completes with the `ToolResult`."""
        future: Future[ToolResult] = Future()
        schema = self._schemas.get(name)
        if schema is None:
            known = ", ".join(self._schemas)
            message = f"Unknown tool {name!r}; the tools are: {known}"
            future.set_result(ToolResult(message, "unknown_tool", 0.0))
            return future
        problem = check_arguments(schema, arguments)
        if problem is None:
            try:
                payload = json.dumps({"name": name, "arguments": arguments}).encode()
            except (TypeError, ValueError) as e:  # a list or dict holding what JSON cannot
                problem = f"not JSON: {e}"
        if problem is not None:
            message = f"Bad arguments for {name!r}: {problem}"
            future.set_result(ToolResult(message, "bad_arguments", 0.0))
            return future
        with self._lock:
            if self._failure is not None:
                raise RuntimeError("the tool pool has failed") from self._failure
            if self._closed:
                raise RuntimeError("the tool pool is closed")
            self._pending.append(_Call(payload, future))
            self._wake()  # under the lock: close() closes the pipe only after it set _closed
        return future

    def close(self) -> None:
        """Stop the workers (killing the calls in flight, whose directories go with their
        sandboxes). Calls not started are cancelled; those in flight end with a RuntimeError."""
        with self._lock:
            if self._wake_r < 0:
                return  # closed before
            self._closed = True
            queued = list(self._pending)
            self._pending.clear()
            self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        in_flight = [w.call for w in self._workers if w.call is not None]
        stop_workers([w.proc for w in self._workers])
        self._workers = []
        for call in queued:
            call.future.cancel()
        for call in in_flight:
            if not call.future.done():
                call.future.set_exception(RuntimeError("the tool pool was closed during the call"))
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the thread will wake anyway

    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                self._dispatch()
                self._step()
        except BaseException as e:  # a worker that cannot start: no call can run any more
            with self._lock:
                self._failure = e
                calls = [*self._pending, *(w.call for w in self._workers if w.call is not None)]
                self._pending.clear()
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(RuntimeError(f"the tool pool failed: {e}"))

    def _start(self) -> _Worker:
        proc = start_worker(
            "rl.agents.tool_worker", self._env, self._memory_mb, self._log_file, self._read_paths
        )
        self.isolation = proc.isolation
        proc.conn.send_bytes(self._settings)
        return _Worker(proc)

    def _replace(self, w: _Worker) -> None:
        w.proc.kill()
        self._workers[self._workers.index(w)] = self._start()

    def _dispatch(self) -> None:
        # Only idle workers get a call: they are blocked in recv, so the send cannot block.
        for w in self._workers:
            if not w.ready or w.call is not None:
                continue
            call = self._next_call()
            if call is None:
                return
            w.call, w.busy_since = call, time.monotonic()
            try:
                w.proc.conn.send_bytes(call.payload)
            except OSError:
                self._on_death(w)  # died while idle: the call fails as a crash

    def _next_call(self) -> _Call | None:
        """The first queued call not cancelled meanwhile, now running; None if there is none."""
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                if call.future.set_running_or_notify_cancel():
                    return call
        return None

    def _deadline(self, w: _Worker) -> float:
        if not w.ready:
            return w.proc.started_at + STARTUP_TIMEOUT_S
        if w.call is None:
            return math.inf
        return w.busy_since + self._timeout_s + WORKER_GRACE_S

    def _step(self) -> None:
        """Wait until a message or a submission arrives or the nearest deadline passes, and
        take in what arrived."""
        wait_s = min(self._deadline(w) for w in self._workers) - time.monotonic()
        conns = [w.proc.conn for w in self._workers]
        ready = wait([*conns, self._wake_r], timeout=max(0.0, min(wait_s, 3600.0)))
        if self._wake_r in ready:
            os.read(self._wake_r, 1 << 16)
        for w in [w for w in self._workers if w.proc.conn in ready]:
            self._receive(w)
        now = time.monotonic()
        for w in [w for w in self._workers if now >= self._deadline(w)]:
            if not w.ready:
                raise RuntimeError(
                    f"a tool worker process did not start within {STARTUP_TIMEOUT_S:.0f} s"
                )
            message = f"Timeout: the tool's worker did not report within {self._timeout_s:g} s"
            self._finish(w, ToolResult(message, "timeout", now - w.busy_since))
            self._replace(w)

    def _receive(self, w: _Worker) -> None:
        try:
            message = json.loads(w.proc.conn.recv_bytes(self._max_message))
        except (EOFError, OSError, ValueError):  # it died (or, a bug, sent junk)
            self._on_death(w)
            return
        if "failed" in message:
            raise RuntimeError(f"a tool worker could not import the tools: {message['failed']}")
        if "ready" in message:
            w.ready = True
            for name, schema in message["schemas"].items():
                if name in self._schemas and self._schemas[name] is None:
                    self._schemas[name] = check_schema(name, schema)
            return
        seconds = time.monotonic() - w.busy_since
        self._finish(w, ToolResult(message["output"], message["error"], seconds))

    def _finish(self, w: _Worker, result: ToolResult) -> None:
        call, w.call = w.call, None
        assert call is not None, "a tool worker sent a result without a call"
        if not call.future.done():
            call.future.set_result(result)

    def _on_death(self, w: _Worker) -> None:
        code = w.proc.kill(grace_s=1.0)  # it closed the connection; it may not have exited yet
        if not w.ready:
            raise RuntimeError(f"a tool worker process exited while starting (exit code {code})")
        if w.call is not None:
            message = f"Crash: the tool's worker process died (exit code {code})"
            self._finish(w, ToolResult(message, "crash", time.monotonic() - w.busy_since))
        self._replace(w)


def tool_schemas(tools: Sequence[str | Callable]) -> list[dict]:
    """The function schemas of `tools`, for the chat template: read here for built-in and
    imported tools, by a one-worker pool when a user's file is among them."""
    specs = [resolve_tool(tool) for tool in tools]
    if all(spec.schema is not None for spec in specs):
        return [spec.schema for spec in specs]
    with ToolPool(tools, num_workers=1) as pool:
        return pool.schemas
