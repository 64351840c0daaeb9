"""Worker processes that evaluate reward functions with a per-item timeout.

User code can raise, hang in a loop or a C call, or kill its process; none of that may stop
training. Each worker (`rl.rewards.pool_worker`) is a fresh interpreter, not a fork of the
driver (whose Ray and torch threads a fork would copy mid-lock), that loads the function terms
once and then scores chunks of items, sending one result per item, all in JSON (the driver never
unpickles what a process that imported a user's file sent). Results arrive in order, so
the driver knows when each item started: when the previous one's result arrived. An item past
its deadline costs its worker, which is killed and replaced; the items queued behind it go to
the other workers.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Literal

from rl.config import RewardConfig
from rl.isolation import Isolation
from rl.rewards.terms import FunctionTerm
from rl.sandbox import (
    CAUSE_CHARS,
    STARTUP_TIMEOUT_S,
    WorkerProcess,
    clean_env,
    start_worker,
    stop_workers,
)

# (term index, response, example)
Item = tuple[int, str, dict]
MAX_CHUNK = 64  # items per message; chunks shrink as the queue drains, to balance the workers
MAX_REPLY_BYTES = 1 << 16  # a result: a number, or an error cut to rl.sandbox.CAUSE_CHARS


@dataclass(frozen=True)
class Failure:
    """An item that raised ("error") or missed its deadline ("timeout")."""

    kind: Literal["error", "timeout"]
    cause: str


@dataclass
class _Worker:
    proc: WorkerProcess
    ready: bool = False
    busy_since: float = 0.0  # when the item at the head of `outstanding` started
    outstanding: deque[int] = field(default_factory=deque)


class FunctionPool:
    """`cfg.num_processes` workers scoring `Item`s against `terms`, each item within
    `cfg.timeout_s`. Each worker runs in a sandbox (rl.sandbox; `isolation` says what it got)
    with a clean environment (`rl.sandbox.BASE_ENV` and `cfg.inherit_env`), an address-space
    limit of `cfg.memory_mb`, and its stdout and stderr appended to `log_file` (None: the
    driver's stderr), never the driver's stdout."""

    def __init__(
        self, terms: list[FunctionTerm], cfg: RewardConfig, log_file: str | None = None
    ) -> None:
        if cfg.num_processes < 1:
            raise ValueError(f"reward.num_processes must be >= 1, got {cfg.num_processes}")
        self._terms = json.dumps([term.to_json() for term in terms]).encode()
        self._read_paths = [term.path for term in terms if term.kind == "file"]
        self._timeout_s = cfg.timeout_s
        self._memory_mb = cfg.memory_mb
        self._env = clean_env(cfg.inherit_env)
        self._log_file = log_file
        self._workers: list[_Worker] = []
        try:
            for _ in range(cfg.num_processes):
                self._workers.append(self._start())
        except BaseException:
            self.close()
            raise
        self.isolation: Isolation = self._workers[0].proc.isolation
        # Wait here, so that a broken term fails before any training work starts.
        try:
            while not all(w.ready for w in self._workers):
                self._receive(time.monotonic(), [], deque())
                self._expire(time.monotonic(), [], deque())
        except BaseException:
            self.close()
            raise

    def run(self, items: list[Item], fail_fast: bool = False) -> list[float | Failure | None]:
        """One result per item: its score or a `Failure`.

        With `fail_fast`, stops at the first failure: the workers are replaced (abandoning
        their queues) and items not scored yet are None.
        """
        results: list[float | Failure | None] = [None] * len(items)
        pending = deque(range(len(items)))
        try:
            while pending or any(w.outstanding for w in self._workers):
                now = time.monotonic()
                self._dispatch(items, pending, now)
                self._receive(now, results, pending)
                self._expire(time.monotonic(), results, pending)
                if fail_fast and any(isinstance(r, Failure) for r in results):
                    self._restart_all()
                    break
        except BaseException:
            # Interrupted mid-batch: stale results must not reach the next call.
            self._restart_all()
            raise
        return results

    def close(self) -> None:
        """Stop the workers: idle ones exit on EOF, busy ones are killed."""
        stop_workers([w.proc for w in self._workers])
        self._workers = []

    def _start(self) -> _Worker:
        proc = start_worker(
            "rl.rewards.pool_worker", self._env, self._memory_mb, self._log_file, self._read_paths
        )
        proc.conn.send_bytes(self._terms)
        return _Worker(proc)

    def _replace(self, w: _Worker, pending: deque[int]) -> None:
        """Kill `w`, start a fresh worker in its place and requeue `w`'s unstarted items."""
        pending.extendleft(reversed(w.outstanding))
        w.proc.kill()
        self._workers[self._workers.index(w)] = self._start()

    def _restart_all(self) -> None:
        for w in list(self._workers):
            w.outstanding.clear()
            self._replace(w, deque())

    def _dispatch(self, items: list[Item], pending: deque[int], now: float) -> None:
        # Only idle workers get work: they are blocked in recv, so a large send cannot block.
        for w in self._workers:
            if not pending or not w.ready or w.outstanding:
                continue
            size = min(MAX_CHUNK, -(-len(pending) // (2 * len(self._workers))))
            ids = [pending.popleft() for _ in range(size)]
            try:
                w.proc.conn.send_bytes(json.dumps([(i, *items[i]) for i in ids]).encode())
            except OSError:  # died while idle: nothing of this chunk ran
                pending.extendleft(reversed(ids))
                self._replace(w, pending)
                continue
            w.outstanding.extend(ids)
            w.busy_since = now

    def _deadline(self, w: _Worker) -> float:
        if not w.ready:
            return w.proc.started_at + STARTUP_TIMEOUT_S
        return w.busy_since + self._timeout_s if w.outstanding else math.inf

    def _receive(self, now: float, results: list, pending: deque[int]) -> None:
        """Wait until a message arrives or the nearest deadline, and take every message in."""
        wait_s = min(self._deadline(w) for w in self._workers) - now
        conns = [w.proc.conn for w in self._workers]
        ready = wait(conns, timeout=max(0.0, min(wait_s, 3600.0)))
        for w in [w for w in self._workers if w.proc.conn in ready]:
            try:
                while w.proc.conn.poll():
                    kind, item_id, payload = _reply(w.proc.conn.recv_bytes(MAX_REPLY_BYTES))
                    if kind == "ready":
                        w.ready = True
                    elif kind == "failed":
                        raise RuntimeError(f"a reward worker could not load the terms: {payload}")
                    else:
                        if item_id != (w.outstanding[0] if w.outstanding else None):
                            raise ValueError(f"a result for item {item_id} it was not scoring")
                        w.outstanding.popleft()
                        results[item_id] = payload if kind == "ok" else Failure("error", payload)
                        w.busy_since = time.monotonic()
            except (EOFError, OSError, ValueError) as e:
                self._on_death(w, results, pending, e)

    def _on_death(
        self, w: _Worker, results: list, pending: deque[int], error: BaseException
    ) -> None:
        """`w` died, or sent what is not a reply (user code wrote to its connection)."""
        code = w.proc.kill(grace_s=1.0)  # it may not have exited yet
        if isinstance(error, ValueError):
            what = f"sent what is not a reply ({error}; killed, exit code {code})"
        else:
            what = f"exited (exit code {code})"
        if not w.ready:
            message = f"a reward worker process {what} while starting"
            raise RuntimeError(message[:CAUSE_CHARS])
        if w.outstanding:
            # The function it was running took the process down (os._exit, a crash, OOM) or
            # wrote to the connection.
            cause = f"the worker process {what}"[:CAUSE_CHARS]
            results[w.outstanding.popleft()] = Failure("error", cause)
        self._replace(w, pending)

    def _expire(self, now: float, results: list, pending: deque[int]) -> None:
        for w in list(self._workers):
            if now < self._deadline(w):
                continue
            if not w.ready:
                raise RuntimeError(
                    f"a reward worker process did not start within {STARTUP_TIMEOUT_S:.0f} s"
                )
            cause = f"no result within reward.timeout_s={self._timeout_s:g} s"
            results[w.outstanding.popleft()] = Failure("timeout", cause)
            self._replace(w, pending)


def _reply(data: bytes) -> tuple[str, int, object]:
    """A worker's message: [kind, item id, payload], checked; ValueError for anything else."""
    message = json.loads(data)
    if not (isinstance(message, list) and len(message) == 3):
        raise ValueError(f"not a reply: {data[:100]!r}")
    kind, item_id, payload = message
    valid = isinstance(item_id, int) and (
        (kind == "ok" and isinstance(payload, int | float) and math.isfinite(payload))
        or (kind in ("error", "failed") and isinstance(payload, str))
        or (kind == "ready" and payload is None)
    )
    if not valid:
        raise ValueError(f"not a reply: {data[:100]!r}")
    return kind, item_id, payload
