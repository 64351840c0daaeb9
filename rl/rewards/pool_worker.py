"""A reward worker process: `python -m rl.rewards.pool_worker FD`, driven by `FunctionPool`.

It receives the function terms over the connection at FD, loads them, says "ready", then
scores chunks of items, sending one result per item in order, until the driver closes the
connection. Every message is JSON, both ways: the driver never unpickles what a process
running a user's file could have sent. Started in a sandbox (rl.sandbox) as a fresh
interpreter rather than through multiprocessing, which would re-run the driver's main module
(and import torch, Ray and vLLM) in every worker.
"""

from __future__ import annotations

import json
import math
import sys

from rl.rewards.terms import FunctionTerm, RewardFn
from rl.sandbox import connect, describe


def _score(fn: RewardFn, item_id: int, response: str, example: dict) -> list:
    try:
        value = float(fn(response, example))
    except Exception as e:
        return ["error", item_id, describe(e)]
    if not math.isfinite(value):  # a NaN reward would poison every advantage of its group
        return ["error", item_id, f"returned {value}, not a finite number"]
    return ["ok", item_id, value]


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    conn = connect(fd)

    def send(message: list) -> None:
        conn.send_bytes(json.dumps(message).encode())

    try:
        terms = [FunctionTerm.from_json(t) for t in json.loads(conn.recv_bytes())]
        try:
            fns = [term.load() for term in terms]
        except Exception as e:
            send(["failed", -1, describe(e)])
            return
        send(["ready", -1, None])
        while True:
            for item_id, term_index, response, example in json.loads(conn.recv_bytes()):
                send(_score(fns[term_index], item_id, response, example))
    except (EOFError, BrokenPipeError):
        return  # the driver closed the connection


if __name__ == "__main__":
    main(int(sys.argv[1]))
