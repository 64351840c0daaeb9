"""Worker processes for code the driver must not run itself: users' reward functions
(rl.rewards.pool), agents' tools (rl.agents.tool_pool) and users' environments
(rl.agents.env_pool).

A worker is `python -m MODULE FD` started through rl.isolation's launcher, a fresh interpreter
rather than a fork of the driver (whose Ray and torch threads a fork would copy mid-lock, and
whose main module multiprocessing would re-run), with a clean environment, in its own session
and, where the kernel allows, its own namespaces as an unprivileged user (rl.isolation says
what it is cut off from). It talks to the driver over the connection at FD, in JSON only: the
driver never unpickles what a process running user code sent. The driver's side is
`start_worker` and `stop_workers`; the worker's side starts with `connect`. A worker never
outlives the driver: it is killed, with every process it started, when its `WorkerProcess` is
garbage-collected or the driver exits, and it exits by itself when the driver dies without
either.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import rl
from rl.config import SandboxConfig
from rl.isolation import Isolation, Limits, Spec

STARTUP_TIMEOUT_S = 120.0  # a worker imports its user code's modules (sympy for `math`) at start
CAUSE_CHARS = 500  # error messages are cut: they travel through a pipe and into logs
_REPO_ROOT = str(Path(rl.__file__).resolve().parent.parent)
# What a worker inherits of the driver's environment unless the caller adds more: the
# interpreter and libraries still work, and the driver's credentials (tokens, keys) stay out.
# HOME tells the launcher which directory to hide; the worker gets a private one in its place.
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None)  # loaded here: a forked child should not run the dynamic loader
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONPATH", "VIRTUAL_ENV")


class SandboxRefused(RuntimeError):
    """`sandbox.require` is set and the kernel did not give a worker full isolation."""


# This process's sandbox policy: the run's `sandbox` section, which the driver and each
# rollout worker set at start (`configure`); the section's defaults elsewhere.
_policy = SandboxConfig()


def configure(cfg: SandboxConfig) -> None:
    """Start this process's sandboxed workers under `cfg` from now on."""
    global _policy
    _policy = cfg


def clean_env(inherit: Sequence[str], python_path: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a worker: `BASE_ENV` and `inherit` where the driver has them. The
    workers import `rl` (and the `python_path` roots) wherever the driver was started from."""
    env = {name: os.environ[name] for name in (*BASE_ENV, *inherit) if name in os.environ}
    roots = [_REPO_ROOT, *python_path, env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, roots)))
    return env


@dataclass
class WorkerProcess:
    """A started worker: its launcher's process, the driver's end of its connection, and the
    isolation it got."""

    process: subprocess.Popen
    conn: Connection
    started_at: float
    isolation: Isolation
    _kill: weakref.finalize  # kills the process now, or at the driver's exit at the latest

    def kill(self, grace_s: float = 0.0) -> int:
        """Kill it (it may be busy) with every process it started, unless it exits within
        `grace_s`; reap it and close the connection; its exit code."""
        try:
            self.process.wait(timeout=grace_s)  # (a worker that closed its connection exits)
        except subprocess.TimeoutExpired:
            pass
        self._kill()  # also drops its exit hook; a second call does nothing
        code = self.process.wait()
        self.conn.close()
        return code


def _end(pid: int, scratch: list[str]) -> None:
    """Kill a worker's session (the launcher leads it; in a pid namespace the worker's
    processes die with the worker) while its launcher runs, and remove its private directory,
    if it has one. Not once the launcher is reaped: its number may be another process's."""
    try:
        running = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped
        running = False
    if running:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for path in scratch:
        shutil.rmtree(path, ignore_errors=True)


def start_worker(
    module: str,
    env: dict[str, str],
    memory_mb: int,
    log_file: str | None,
    read_paths: Sequence[str] = (),
    loopback: bool = False,
) -> WorkerProcess:
    """Start `python -m module FD` in a sandbox (rl.isolation) under this process's policy
    (`configure`) and an address-space limit of `memory_mb` MiB (0: none), with environment
    `env`, the users' files `read_paths` readable, its own loopback up if `loopback` (its only
    network either way), and its stdout and stderr appended to
    `log_file` (None: the driver's stderr), never the driver's stdout. Returns once the
    sandbox is up; SandboxRefused when `sandbox.require` is set and it is not fully isolated."""
    conn, child_conn = Pipe()
    limits = Limits(memory_mb, _policy.tmp_mb, _policy.require)
    spec = Spec(limits, tuple(read_paths), loopback)
    if log_file is None:
        output = sys.stderr
    else:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        output = open(log_file, "ab")  # the child keeps its own copy of the descriptor
    fd = child_conn.fileno()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "rl.isolation", spec.to_json(), module, str(fd)],
            pass_fds=[fd],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            env=env,
            start_new_session=True,  # its own process group: killed as one
        )
    finally:
        if output is not sys.stderr:
            output.close()
    child_conn.close()  # only the child holds its end now, so its death reads as EOF
    scratch: list[str] = []  # the launcher's private directory, once it says where
    kill = weakref.finalize(process, _end, process.pid, scratch)
    worker = WorkerProcess(process, conn, time.monotonic(), Isolation(), kill)
    try:
        if not conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"did not start within {STARTUP_TIMEOUT_S:g} s")
        report = json.loads(conn.recv_bytes(1 << 16))
        if "failed" in report:
            raise RuntimeError(f"it could not be set up: {report['failed']}")
        worker.isolation = Isolation.from_json(report["isolation"])
        if report["scratch"] is not None:
            scratch.append(str(report["scratch"]))
    except (EOFError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        code = worker.kill()
        raise RuntimeError(
            f"the sandbox of a {module} worker failed to start (exit code {code}; its log: "
            f"{log_file or 'stderr'}): {e}"
        ) from None
    if "refused" in report:
        worker.kill()
        raise SandboxRefused(str(report["refused"])[:CAUSE_CHARS])
    return worker


def probe() -> Isolation:
    """The isolation this process's sandboxed workers get, from a worker started and stopped
    at once; SandboxRefused when `sandbox.require` is set and it is not full."""
    # (A module with no main; what the launcher has to say travels in its report.)
    worker = start_worker("rl.sandbox", clean_env(()), 0, os.devnull)
    worker.kill()
    return worker.isolation


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
    """In a worker, first thing: the connection to the driver at `fd`. (The launcher already
    sees to it that the worker dies with the driver.)"""
    return Connection(fd)


def fork_group(child: Callable[[], None], close: Sequence[int] = ()) -> int:
    """In a worker: fork a process that closes `close`, runs `child` and ends (exit code 0,
    or EX_SOFTWARE when it raised or never ran), in a process group of its own, so that it
    ends with every process it started (`kill_group`), and dying with the worker; its pid."""
    worker = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: it must end here, whatever happens
        code = os.EX_SOFTWARE
        try:
            os.setpgid(0, 0)
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() == worker:  # (else the worker died before the signal was armed)
                for fd in close:
                    os.close(fd)
                child()
                code = 0
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # also here: a kill must not find the group not made yet
    except OSError:
        pass  # the child made it, or already exited
    return pid


def kill_group(pid: int) -> None:
    """Kill a `fork_group` process and every process it started (its group). Before `pid` is
    reaped, so that neither number can belong to another process yet."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe(e: BaseException) -> str:
    """`Type: message`, cut to CAUSE_CHARS."""
    return f"{type(e).__name__}: {e}"[:CAUSE_CHARS]
