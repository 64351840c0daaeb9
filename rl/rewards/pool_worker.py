"""A reward worker process: `python -m rl.rewards.pool_worker FD`, driven by `FunctionPool`.

It receives the function terms over the connection at FD, loads them, says "ready", then
scores chunks of items, sending one result per item in order, until the driver closes the
connection. Started as a fresh interpreter rather than through multiprocessing, which would
re-run the driver's main module (and import torch, Ray and vLLM) in every worker.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from rl.rewards.terms import RewardFn

CAUSE_CHARS = 500  # error messages are cut: they travel through a pipe and into logs


def describe(e: BaseException) -> str:
    """`Type: message`, cut to CAUSE_CHARS."""
    return f"{type(e).__name__}: {e}"[:CAUSE_CHARS]


def _score(fn: RewardFn, item_id: int, response: str, example: dict) -> tuple[str, int, object]:
    try:
        value = float(fn(response, example))
    except Exception as e:
        return "error", item_id, describe(e)
    if not math.isfinite(value):  # a NaN reward would poison every advantage of its group
        return "error", item_id, f"returned {value}, not a finite number"
    return "ok", item_id, value


def _exit_with_parent(parent: int) -> None:
    # A worker stuck in a user's loop never reads the EOF of a dead driver; this thread still
    # runs (the interpreter switches threads), so the worker does not outlive the driver.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    # Ctrl-C reaches the whole process group; the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    try:
        terms = conn.recv()
        try:
            fns = [term.load() for term in terms]
        except Exception as e:
            conn.send(("failed", -1, describe(e)))
            return
        conn.send(("ready", -1, None))
        while True:
            for item_id, term_index, response, example in conn.recv():
                conn.send(_score(fns[term_index], item_id, response, example))
    except (EOFError, BrokenPipeError):
        return  # the driver closed the connection


if __name__ == "__main__":
    main(int(sys.argv[1]))
