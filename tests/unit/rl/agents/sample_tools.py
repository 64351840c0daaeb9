"""Tools for the ToolPool tests: each misbehaves in one way (or reports what it sees)."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time


def nap(seconds: float) -> list:
    """Sleep, and say when the sleep started and ended (the system-wide monotonic clock).

    Args:
        seconds: How long to sleep.
    """
    start = time.monotonic()
    time.sleep(seconds)
    return [start, time.monotonic()]


def hang(marker: str) -> None:
    """Name this process `marker`, start a child process whose command line holds it, then
    sleep forever. (The host sees the sandbox's processes under other pids: the test finds
    them by the marker.)

    Args:
        marker: A name of at most 15 characters.
    """
    with open("/proc/self/comm", "w") as f:
        f.write(marker)
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1000)  # {marker}"])
    while True:
        time.sleep(1.0)


def spin() -> None:
    """Burn CPU forever."""
    while True:
        pass


def hog(mb: int) -> int:
    """Allocate memory.

    Args:
        mb: How many MiB.
    """
    return len(bytearray(mb << 20))


def flood(mb: int) -> None:
    """Print lines of 1 MiB of "x".

    Args:
        mb: How many lines.
    """
    for _ in range(mb):
        print("x" * (1 << 20))


def die(how: str) -> None:
    """End the process abruptly.

    Args:
        how: "exit" (os._exit(3)) or "segfault".
    """
    if how == "exit":
        os._exit(3)
    ctypes.string_at(0)


def fail() -> None:
    """Raise."""
    print("about to fail")
    raise KeyError("no such thing")


def junk(kind: str) -> object:
    """Return something that is not a tool's value.

    Args:
        kind: "set" or "list".
    """
    return {1, 2} if kind == "set" else [object()]


def environment() -> dict:
    """The process's environment and working directory."""
    return {"env": dict(os.environ), "cwd": os.getcwd()}


def scribble() -> list:
    """List the working directory, then write a file into it."""
    before = sorted(os.listdir("."))
    with open("note.txt", "w") as f:
        f.write("left behind?")
    return [os.getcwd(), before]


def background(marker: str) -> None:
    """Start a process that would outlive the call, in a session of its own, its command
    line holding `marker`.

    Args:
        marker: What the test finds the process by.
    """
    code = f"import time; time.sleep(1000)  # {marker}"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def read(path: str) -> str:
    """A file's text, or why it cannot be read.

    Args:
        path: The file; "~" is the tool's home.
    """
    try:
        with open(os.path.expanduser(path)) as f:
            return f.read()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror}"


def network(port: int) -> dict:
    """The network namespace, and whether a connection to the host's port succeeds.

    Args:
        port: A port listening on 127.0.0.1 outside the sandbox.
    """
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        connected = True
    except OSError:
        connected = False
    return {"namespace": os.readlink("/proc/self/ns/net"), "connected": connected}
