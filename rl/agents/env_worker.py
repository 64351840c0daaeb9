"""An environment worker process: `python -m rl.agents.env_worker FD`, driven by
`rl.agents.env_pool.EnvPool`.

It receives the environment's `path/to/file.py:ClassName` over the connection at FD, imports
the class (the only place a user's environment code runs), says "ready" with the class's `tools`, then serves one request at a time
until the driver closes the connection. The driver sends and reads JSON only; an
environment's state travels between requests as the bytes of the pickled object, which only a
worker unpickles. So the driver never unpickles what user code produced, and an episode's
environment can continue in any worker of any process.
"""

from __future__ import annotations

import json
import pickle
import sys

from rl.agents.environment import Environment, EnvStep
from rl.sandbox import connect, describe
from rl.user_code import load_file_object, parse_file_ref


def load_environment(ref: str) -> type[Environment]:
    """The class `ref` ("path/to/file.py:ClassName") names; ValueError naming what is wrong."""
    what = f"agent.environment {ref!r}"
    parsed = parse_file_ref(ref, what)
    assert parsed is not None, f"not a file reference: {ref!r}"
    cls = load_file_object(what, *parsed)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{what} is not a subclass of rl.agents.environment.Environment")
    tools = cls.tools
    if not (isinstance(tools, list | tuple) and all(isinstance(t, str) for t in tools)):
        raise ValueError(f"{what}: `tools` must be a tuple of tool names, got {tools!r}")
    return cls


def _serve(cls: type[Environment], request: dict, state: bytes | None) -> tuple[dict, bytes | None]:
    """One request's reply and the environment's new state (None: it has none to keep)."""
    op = request["op"]
    if op == "reset":
        env = cls()
        return {"messages": env.reset(request["example"])}, pickle.dumps(env)
    if op == "demonstration":
        return {"messages": cls().demonstration(request["example"])}, None
    assert op == "step", f"unknown request {op!r}"
    env = pickle.loads(state)
    step = env.step(request["turn"], request["tool_messages"])
    if not isinstance(step, EnvStep):
        raise TypeError(f"step returned a {type(step).__name__}, not an EnvStep")
    reply = {"messages": step.messages, "reward": step.reward, "done": step.done}
    return reply, pickle.dumps(env)


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    conn = connect(fd)
    try:
        ref = json.loads(conn.recv_bytes())["ref"]
        try:
            cls = load_environment(ref)
        except Exception as e:
            conn.send_bytes(json.dumps({"failed": describe(e)}).encode())
            return
        ready = {"ready": True, "tools": list(cls.tools)}
        conn.send_bytes(json.dumps(ready).encode())
        while True:
            request = json.loads(conn.recv_bytes())
            state = conn.recv_bytes() if request.get("has_state") else None
            try:
                reply, state = _serve(cls, request, state)
                message = json.dumps({**reply, "has_state": state is not None}).encode()
            except Exception as e:  # the user's code failed, or its result is not JSON
                message, state = json.dumps({"error": describe(e)}).encode(), None
            conn.send_bytes(message)
            if state is not None:
                conn.send_bytes(state)
    except (EOFError, BrokenPipeError):
        return  # the pool closed, or its process died


if __name__ == "__main__":
    main(int(sys.argv[1]))
