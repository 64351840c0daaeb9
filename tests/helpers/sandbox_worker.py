"""A worker for the tests of rl.sandbox: `python -m tests.helpers.sandbox_worker FD` runs what
the test asks of its sandbox and answers in JSON, one message per request:

- "whoami": its environment, uids, capabilities, limits and working directory;
- ["read", PATH]: the file's text, or the error;
- ["connect", PORT]: whether a TCP connection to 127.0.0.1:PORT succeeded, or the error;
- ["setns", PATH]: whether setns() into the network namespace at PATH succeeded, or the error;
- ["write", PATH, MIB]: how many MiB it could write to PATH before an error, and the error;
- ["spawn", MARKER]: starts a sleeping process whose command line holds MARKER (in its own
  session, as a process escaping its parent's group would), answers its pid;
- "hang": busy forever.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from rl.sandbox import connect


def _status(field: str) -> str:
    line = next(
        x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field)
    )
    return line.split(":", 1)[1].strip()


def _try(fn) -> dict:
    try:
        return {"ok": fn()}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _setns(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    return 0


def _write(path: str, mib: int) -> int:
    written = 0
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(b"\0" * (1 << 20))
            f.flush()
            written += 1
    return written


def _answer(request: object) -> object:
    if request == "whoami":
        return {
            "env": dict(os.environ),
            "uid": os.getuid(),
            "cap_eff": _status("CapEff"),
            "no_new_privs": _status("NoNewPrivs"),
            "memory_limit": resource.getrlimit(resource.RLIMIT_AS)[0],
            "cwd": os.getcwd(),
            "pid": os.getpid(),
        }
    kind, arg, *rest = request
    if kind == "read":
        return _try(lambda: Path(arg).read_text())
    if kind == "connect":
        return _try(lambda: socket.create_connection(("127.0.0.1", arg), timeout=2).close())
    if kind == "setns":
        return _try(lambda: _setns(arg))
    if kind == "write":
        return _try(lambda: _write(arg, rest[0]))
    assert kind == "spawn", request
    code = f"import time; time.sleep(600)  # {arg}"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True).pid


def main(fd: int) -> None:
    conn = connect(fd)
    try:
        while (request := json.loads(conn.recv_bytes())) != "hang":
            conn.send_bytes(json.dumps(_answer(request)).encode())
    except EOFError:
        return
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
