"""A reward worker process: `python -m rl.rewards.pool_worker FD`, driven by `FunctionPool`.

It receives the function terms over the connection at FD, loads them, says "ready", then
scores chunks of items, sending one result per item in order, until the driver closes the
connection. Started as a fresh interpreter rather than through multiprocessing, which would
re-run the driver's main module (and import torch, Ray and vLLM) in every worker (rl.sandbox).
"""

from __future__ import annotations

import math
import sys

from rl.rewards.terms import RewardFn
from rl.sandbox import connect, describe


def _score(fn: RewardFn, item_id: int, response: str, example: dict) -> tuple[str, int, object]:
    try:
        value = float(fn(response, example))
    except Exception as e:
        return "error", item_id, describe(e)
    if not math.isfinite(value):  # a NaN reward would poison every advantage of its group
        return "error", item_id, f"returned {value}, not a finite number"
    return "ok", item_id, value


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    conn = connect(fd)
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
