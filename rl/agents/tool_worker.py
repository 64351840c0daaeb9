"""A tool worker process: `python -m rl.agents.tool_worker FD`, driven by `ToolPool`.

It receives its settings over the connection at FD, imports the tools, says "ready", then
runs one call at a time until the driver closes the connection. Every message is JSON, both ways: the driver
never unpickles what a process running model-written code could have sent.

Each call runs in a fork of the worker, in its own process group, working directory
(removed afterwards; HOME and TMPDIR point there too) and CPU-time limit, its stdout and
stderr on a pipe of which the worker keeps the first `max_output_chars` characters and
discards the rest. So nothing a tool does to its process (globals, imported modules, threads,
signals, a crash) outlives the call or reaches the next one, and the worker, which runs no
tool code, enforces the wall-clock timeout and reports what happened.
"""

from __future__ import annotations

import codecs
import importlib
import json
import math
import os
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from rl.sandbox import connect, describe, fork_group, kill_group
from rl.user_code import load_file_object, parse_file_ref


@dataclass(frozen=True)
class Settings:
    """What the driver sends a worker first (as JSON)."""

    tools: dict[str, str]  # name -> "module:function" or "/path/file.py:function"
    describe: list[str]  # the tools whose schemas the driver asks for (users' files)
    timeout_s: float
    cpu_s: float
    memory_mb: int
    max_output_chars: int


def import_tool(spec: str) -> Callable:
    """The object that `spec` ("module:qualified.name" or "/path/file.py:name") names."""
    ref = parse_file_ref(spec, f"tool {spec!r}")
    if ref is not None:
        return load_file_object(f"tool {spec!r}", *ref)
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Output:
    """The first `limit` characters of a UTF-8 byte stream; the rest is only counted, so a
    tool that prints gigabytes costs time (within its timeout), not memory."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._parts: list[str] = []
        self._kept = 0
        self.dropped = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        kept = text[: self._limit - self._kept]
        self._parts.append(kept)
        self._kept += len(kept)
        self.dropped += len(text) - len(kept)

    @property
    def text(self) -> str:
        return "".join(self._parts)


def _as_text(value: object) -> str:
    """A tool's return value as the model sees it; TypeError for anything else (junk)."""
    if value is None:
        return ""
    if isinstance(value, str | int | float):  # bool too
        return str(value)
    if isinstance(value, list | dict):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise TypeError(
                f"the tool returned a {type(value).__name__} that is not JSON: {e}"
            ) from None
    raise TypeError(
        f"the tool returned a {type(value).__name__}, not str, int, float, bool, None, list or dict"
    )


def _call(fn: Callable, arguments: dict, s: Settings, workdir: str, out_w: int, res_w: int) -> None:
    """In the call's process: run `fn` under the limits, its output on `out_w`; write the
    result to `res_w` as JSON."""
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.close(out_w)
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    tempfile.tempdir = None  # computed again from TMPDIR
    cpu = math.ceil(s.cpu_s)
    # SIGXCPU ends the process at `cpu` seconds; SIGKILL a second later if the tool caught it.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    try:
        text, error = _as_text(fn(**arguments)), None
    except MemoryError:
        text = f"MemoryError: the tool ran out of memory (memory_mb={s.memory_mb})"
        error = "memory"
    except BaseException as e:  # SystemExit too: the call failed, the process is ours to end
        text, error = describe(e), "error"
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()  # os._exit, which ends this process, does not flush
        except Exception:
            pass
    kept = text[: s.max_output_chars]
    with open(res_w, "w", encoding="utf-8") as f:
        json.dump({"text": kept, "more": len(text) - len(kept), "error": error}, f)


def _end_the_rest() -> None:
    """In a pid namespace of its own (rl.isolation), where this worker is pid 1: kill every
    other process, such as one a call started in a session of its own, which its group's kill
    missed, and reap them (orphans of the namespace are this worker's children)."""
    if os.getpid() != 1:
        return  # without a pid namespace, -1 would mean every process of this uid on the host
    try:
        os.kill(-1, signal.SIGKILL)  # every process of the namespace but its pid 1
    except ProcessLookupError:
        return  # none
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # every one reaped
            return


def _run(fn: Callable, arguments: dict, s: Settings, conn_fd: int) -> dict:
    """Run one call in a fork; its {"output", "error"} message for the driver. EOFError when
    the driver closed the connection meanwhile (the call's processes are killed first)."""
    workdir = tempfile.mkdtemp(prefix="call-")  # in the sandbox's private TMPDIR
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = fork_group(
        lambda: _call(fn, arguments, s, workdir, out_w, res_w), close=(conn_fd, out_r, res_r)
    )
    os.close(out_w)
    os.close(res_w)
    try:
        output, result, timed_out, status, cpu_s = _collect(pid, out_r, res_r, conn_fd, s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _report(output, result, timed_out, status, cpu_s, s)


def _collect(
    pid: int, out_r: int, res_r: int, conn_fd: int, s: Settings
) -> tuple[_Output, bytes, bool, int, float]:
    """Read the call's output and result until it has exited and the pipes are closed, or
    until its timeout; then kill what is left of it and reap it. (output, result bytes, timed
    out, wait status, CPU seconds used)."""
    deadline = time.monotonic() + s.timeout_s
    output = _Output(s.max_output_chars)
    result = bytearray()
    result_cap = 12 * s.max_output_chars + 4096  # JSON escapes a character in up to 12 bytes
    pidfd = os.pidfd_open(pid)
    selector = selectors.DefaultSelector()
    for fd in (out_r, res_r, pidfd, conn_fd):
        selector.register(fd, selectors.EVENT_READ)
    exited = driver_gone = False
    try:
        while len(selector.get_map()) > 1:  # the connection stays registered
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                if key.fd == conn_fd:  # the driver sends nothing during a call: it closed
                    driver_gone = True
                elif key.fd == pidfd:
                    # It exited: what it started goes too, so that the pipes close.
                    exited = True
                    kill_group(pid)
                    selector.unregister(pidfd)
                    continue
                else:
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fd)
                    elif key.fd == out_r:
                        output.feed(data)
                    elif len(result) < result_cap:
                        result += data
            if driver_gone:
                break
        kill_group(pid)
        _, status, usage = os.wait4(pid, 0)
        _end_the_rest()
    finally:
        selector.close()
        for fd in (out_r, res_r, pidfd):
            os.close(fd)
    if driver_gone:
        raise EOFError("the driver closed the connection during a call")
    output.feed(b"", final=True)
    return output, bytes(result), not exited, status, usage.ru_utime + usage.ru_stime


def _parse(result: bytes) -> dict | None:
    """The call's result message, or None if it wrote none (it died) or junk."""
    try:
        message = json.loads(result)
    except ValueError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("text"), str):
        return None
    if message.get("error") not in (None, "error", "memory"):
        return None
    return message if isinstance(message.get("more"), int) else None


def _out_of_cpu(status: int, cpu_s: float, s: Settings) -> bool:
    if not os.WIFSIGNALED(status):
        return False
    sig = os.WTERMSIG(status)
    return sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= s.cpu_s)


def _report(
    output: _Output, result: bytes, timed_out: bool, status: int, cpu_s: float, s: Settings
) -> dict:
    """The message for the driver: the error kind (None: it returned), and what the model
    sees: the call's stdout and stderr, then its return value or what went wrong, cut to
    `max_output_chars` with a marker saying how much was left out."""
    more = 0
    if timed_out:
        error, text = "timeout", f"Timeout: the tool did not finish within {s.timeout_s:g} s"
    elif _out_of_cpu(status, cpu_s, s):
        error, text = "timeout", f"Timeout: the tool used more than {s.cpu_s:g} s of CPU time"
    elif (message := _parse(result)) is None:
        if os.WIFSIGNALED(status):
            how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            how = f"exited with code {os.WEXITSTATUS(status)}"
        error, text = "crash", f"Crash: the tool's process {how} without returning"
    else:
        error, text, more = message["error"], message["text"], message["more"]
    printed = output.text
    full = printed + ("\n" if printed and text and not printed.endswith("\n") else "") + text
    left_out = output.dropped + more + max(0, len(full) - s.max_output_chars)
    if left_out:
        full = f"{full[: s.max_output_chars]}\n[truncated: {left_out} more characters]"
    return {"output": full, "error": error}


def _schemas(tools: dict[str, Callable], names: list[str]) -> dict[str, dict]:
    if not names:
        return {}
    from rl.agents.tools import tool_schema  # transformers: only where a schema is asked for

    return {name: tool_schema(tools[name]) for name in names}


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    conn = connect(fd)
    try:
        s = Settings(**json.loads(conn.recv_bytes()))
        try:
            tools = {name: import_tool(spec) for name, spec in s.tools.items()}
            schemas = _schemas(tools, s.describe)
        except Exception as e:
            conn.send_bytes(json.dumps({"failed": describe(e)}).encode())
            return
        ready = {"ready": True, "schemas": schemas}
        conn.send_bytes(json.dumps(ready).encode())
        while True:
            call = json.loads(conn.recv_bytes())
            message = _run(tools[call["name"]], call["arguments"], s, fd)
            conn.send_bytes(json.dumps(message).encode())
    except (EOFError, BrokenPipeError):  # the pool closed, or its process died
        return


if __name__ == "__main__":
    main(int(sys.argv[1]))
