"""Worker processes for code the driver must not run itself: users' reward functions
(rl.rewards.pool), agents' tools (rl.agents.tool_pool) and users' environments
(rl.agents.env_pool).

A worker is `python -m MODULE FD`, a fresh interpreter rather than a fork of the driver (whose
Ray and torch threads a fork would copy mid-lock, and whose main module multiprocessing would
re-run), with a clean environment and an address-space limit, talking to the driver over the
connection at FD. The driver's side is `start_worker` and `stop_workers`; the worker's side
starts with `connect`. A worker never outlives the driver: it is killed when its
`WorkerProcess` is garbage-collected or the driver exits, and it exits by itself when the
driver dies without either.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import rl

STARTUP_TIMEOUT_S = 120.0  # a worker imports its user code's modules (sympy for `math`) at start
CAUSE_CHARS = 500  # error messages are cut: they travel through a pipe and into logs
_REPO_ROOT = str(Path(rl.__file__).resolve().parent.parent)
# What a worker inherits of the driver's environment unless the caller adds more: the
# interpreter and libraries still work, and the driver's credentials (tokens, keys) stay out.
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000


def clean_env(inherit: Sequence[str], python_path: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a worker: `BASE_ENV` and `inherit` where the driver has them. The
    workers import `rl` (and the `python_path` roots) wherever the driver was started from."""
    env = {name: os.environ[name] for name in (*BASE_ENV, *inherit) if name in os.environ}
    roots = [_REPO_ROOT, *python_path, env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, roots)))
    return env


def limit_memory(memory_mb: int) -> None:
    """Cap this process's address space at `memory_mb` MiB (0: no cap). Run in the child before
    it execs Python, so that the limit covers everything it does."""
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@dataclass
class WorkerProcess:
    """A started worker: its process and the driver's end of its connection."""

    process: subprocess.Popen
    conn: Connection
    started_at: float
    _kill: weakref.finalize  # kills the process now, or at the driver's exit at the latest

    def kill(self) -> int:
        """Kill it now (it may be busy), reap it and close the connection; its exit code."""
        self._kill()  # also drops its exit hook; a second call does nothing
        code = self.process.wait()
        self.conn.close()
        return code


def start_worker(
    module: str, env: dict[str, str], memory_mb: int, log_file: str | None
) -> WorkerProcess:
    """Start `python -m module FD` with environment `env`, an address-space limit of
    `memory_mb`, and its stdout and stderr appended to `log_file` (None: the driver's stderr),
    never the driver's stdout."""
    conn, child_conn = Pipe()
    if log_file is None:
        output = sys.stderr
    else:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        output = open(log_file, "ab")  # the child keeps its own copy of the descriptor
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(child_conn.fileno())],
            pass_fds=[child_conn.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            env=env,
            preexec_fn=partial(limit_memory, memory_mb),
        )
    finally:
        if output is not sys.stderr:
            output.close()
    child_conn.close()  # only the child holds its end now, so its death reads as EOF
    kill = weakref.finalize(process, process.kill)
    return WorkerProcess(process, conn, started_at=time.monotonic(), _kill=kill)


def stop_workers(workers: Sequence[WorkerProcess], grace_s: float = 2.0) -> None:
    """Close every connection, so that idle workers exit on EOF; kill those still running
    after `grace_s` (busy ones)."""
    for w in workers:
        w.conn.close()
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # busy: killed below
        w.kill()


# The worker's side.


def connect(fd: int) -> Connection:
    """In a worker, first thing: the connection to the driver at `fd`. Ctrl-C is ignored (it
    reaches the whole process group; the driver decides when workers stop), and the worker
    exits when the driver dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    return Connection(fd)


_orphan_cleanups: list[Callable[[], None]] = []


def when_orphaned(cleanup: Callable[[], None]) -> None:
    """In a worker: run `cleanup` before exiting because the driver died (files it would
    have removed on a clean close)."""
    _orphan_cleanups.append(cleanup)


def _exit_with_parent(parent: int) -> None:
    # A worker stuck in a user's loop never reads the EOF of a dead driver; this thread still
    # runs (the interpreter switches threads), so the worker does not outlive the driver.
    while os.getppid() == parent:
        time.sleep(1.0)
    for cleanup in _orphan_cleanups:
        try:
            cleanup()
        except Exception:  # exiting anyway: a failed cleanup must not keep the worker alive
            pass
    os._exit(1)


def isolate_network() -> bool:
    """Move this process (and what it starts later) into a new network namespace, which has
    no interface but a down loopback: nothing it runs can reach any host. Needs root or
    unprivileged user namespaces (then the process also gets a user namespace that maps its
    own uid and gid); False where neither is allowed, or off Linux. Call it while the process
    has one thread: the kernel refuses a user namespace to a threaded process."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) == 0:
        return True
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return False
    # Without these maps the process would be "nobody" inside its namespace.
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def describe(e: BaseException) -> str:
    """`Type: message`, cut to CAUSE_CHARS."""
    return f"{type(e).__name__}: {e}"[:CAUSE_CHARS]
