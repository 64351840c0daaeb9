"""An agent worker process: `python -m rl.agents.agent_worker FD`, driven by
`rl.agents.agent_pool.AgentPool`, in a sandbox whose only network is its own loopback.

It receives its settings over the connection at FD (the agent function's
`/path/file.py:function`, the endpoint's Unix socket, the model name), imports the function
(the only place an agent's code runs), starts the forwarder, says "ready", then runs episodes
until the driver closes the connection. Every message is JSON, both ways.

The forwarder, a process of its own, listens on 127.0.0.1 inside the sandbox's network
namespace and relays each connection to the endpoint's Unix socket (bound into the sandbox
read-only): that is the one address an agent can reach. Each episode runs in a fork of the
worker, in its own process group, as `function(example, base_url=..., api_key=..., model=...)`
with Python's `random` seeded by the episode's seed (and OPENAI_BASE_URL / OPENAI_API_KEY set,
for SDKs that read them). Many episodes run at once, each waiting on its calls; the driver
stops one by asking (its group is killed). What the function returns travels back: a number
(the episode's reward), a string (its final answer) or None.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import selectors
import socket
import ssl
import sys
from collections.abc import Callable

from rl.sandbox import connect, describe, fork_group, kill_group
from rl.user_code import load_file_object, parse_file_ref

MAX_RESULT_CHARS = 1 << 16  # an answer longer than this is cut


def load_agent(ref: str) -> Callable:
    """The function `ref` ("/path/file.py:function") names; ValueError naming what is wrong."""
    what = f"agent.environment 'openai:{ref}'"
    parsed = parse_file_ref(ref, what)
    assert parsed is not None, f"not a file reference: {ref!r}"
    fn = load_file_object(what, *parsed)
    if isinstance(fn, type) or not callable(fn):
        raise ValueError(f"{what} is a {type(fn).__name__}, not a function")
    return fn


def _relay(listener: socket.socket, path: str) -> None:
    """The forwarder: every connection accepted on `listener` joined to a new connection to
    the Unix socket `path`, bytes relayed both ways until either side closes."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    peers: dict[socket.socket, socket.socket] = {}

    def drop(sock: socket.socket) -> None:
        other = peers.pop(sock)
        peers.pop(other, None)
        for s in (sock, other):
            selector.unregister(s)
            s.close()

    while True:
        for key, _ in selector.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    upstream.connect(path)
                except OSError:
                    client.close()
                    upstream.close()
                    continue
                peers[client], peers[upstream] = upstream, client
                selector.register(client, selectors.EVENT_READ)
                selector.register(upstream, selectors.EVENT_READ)
            elif sock in peers:
                try:
                    data = sock.recv(1 << 16)
                    if data:
                        peers[sock].sendall(data)
                        continue
                except OSError:
                    pass
                drop(sock)


def start_forwarder(path: str) -> int:
    """Fork the forwarder to the endpoint at `path`; the port it listens on."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    port = listener.getsockname()[1]
    fork_group(lambda: _relay(listener, path))
    listener.close()
    return port


def _shared_ssl_contexts() -> None:
    """Every `ssl.create_default_context` call with the same arguments gets one context,
    made once. Making one parses the CA bundle, which is most of what an HTTP client (the
    `openai` SDK's, each episode's own) costs to build; in a sandbox that reaches nothing but
    a plain-HTTP endpoint no context is ever used, and sharing one between clients is safe."""
    make = ssl.create_default_context
    made: dict[tuple, ssl.SSLContext] = {}

    def create_default_context(*args: object, **kwargs: object) -> ssl.SSLContext:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make(*args, **kwargs)
        return made[key]

    ssl.create_default_context = create_default_context


def warm_up(base_url: str) -> None:
    """Make one call through the `openai` SDK, if the agent imported it, before episodes fork:
    its lazily imported modules and first-call set-up then load once here, not again in every
    episode (several times the cost of a later client). The endpoint refuses the call (this
    key is no episode's), which is all it takes."""
    _shared_ssl_contexts()
    openai = sys.modules.get("openai")
    if openai is None:
        return
    try:
        client = openai.OpenAI(base_url=base_url, api_key="warm-up", max_retries=0)
        client.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": ""}])
    except Exception:
        pass

    # The async client (asyncio agents, verifiers' harnesses) loads its own transport modules.
    async def call() -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="warm-up", max_retries=0)
        try:
            await client.chat.completions.create(
                model="warm-up", messages=[{"role": "user", "content": ""}]
            )
        finally:
            await client.close()

    try:
        asyncio.run(call())
    except Exception:
        pass


def _result(value: object) -> dict:
    if value is None or isinstance(value, str):
        return {"result": None if value is None else value[:MAX_RESULT_CHARS]}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"result": float(value)}
    raise TypeError(
        f"the agent returned a {type(value).__name__}; return a number (the reward), a string "
        "(the final answer) or None"
    )


def _episode(fn: Callable, request: dict, base_url: str, model: str, result_w: int) -> None:
    """In the episode's process: run the agent; its outcome as JSON on `result_w`."""
    os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = base_url, request["key"]
    random.seed(request["seed"])
    try:
        message = _result(
            fn(request["example"], base_url=base_url, api_key=request["key"], model=model)
        )
    except BaseException as e:  # SystemExit too: the episode failed, the process is ours to end
        message = {"error": describe(e)}
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # os._exit, which ends this process, does not flush
        except Exception:
            pass
    with open(result_w, "w", encoding="utf-8") as f:
        json.dump(message, f)


def _start(fn: Callable, request: dict, base_url: str, model: str, conn_fd: int) -> tuple[int, int]:
    """Fork an episode's process; (its pid, the read end of its result pipe)."""
    result_r, result_w = os.pipe()

    pid = fork_group(
        lambda: _episode(fn, request, base_url, model, result_w), close=(conn_fd, result_r)
    )
    os.close(result_w)
    return pid, result_r


def _serve(conn, fn: Callable, base_url: str, model: str) -> None:  # noqa: ANN001
    """Run episodes as the driver asks, until it closes the connection."""
    selector = selectors.DefaultSelector()
    selector.register(conn.fileno(), selectors.EVENT_READ, None)
    running: dict[int, tuple[int, int, bytearray]] = {}  # id -> (pid, result fd, bytes read)
    try:
        while True:
            for key, _ in selector.select():
                if key.data is None:
                    request = json.loads(conn.recv_bytes())
                    rid = request["id"]
                    if request["op"] == "run":
                        pid, fd = _start(fn, request, base_url, model, conn.fileno())
                        running[rid] = (pid, fd, bytearray())
                        selector.register(fd, selectors.EVENT_READ, rid)
                    elif rid in running:  # "stop"
                        kill_group(running[rid][0])
                    continue
                rid = key.data
                pid, fd, data = running[rid]
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    data += chunk
                    continue
                selector.unregister(fd)
                os.close(fd)
                del running[rid]
                kill_group(pid)  # what the episode left running in its group goes with it
                _, status = os.waitpid(pid, 0)
                try:
                    reply = json.loads(bytes(data))
                except ValueError:
                    reply = {
                        "crash": f"its process ended with status {os.waitstatus_to_exitcode(status)}"
                    }
                conn.send_bytes(json.dumps({"id": rid, **reply}).encode())
    except (EOFError, BrokenPipeError):
        for pid, _, _ in running.values():
            kill_group(pid)


def main(fd: int) -> None:
    """Serve the driver at connection `fd` until it closes it."""
    conn = connect(fd)
    settings = json.loads(conn.recv_bytes())
    try:
        fn = load_agent(settings["ref"])
        # A built-in agent function (rl.agents.verifiers_agent.run) imports the environment it
        # runs here, once, rather than in every episode's fork; one that cannot be imported
        # fails the worker's start, naming it.
        prepare = getattr(fn, "prepare", None)
        if callable(prepare) and settings.get("environment"):
            prepare(settings["environment"])
        port = start_forwarder(settings["socket"])
    except Exception as e:
        conn.send_bytes(json.dumps({"failed": describe(e)}).encode())
        return
    conn.send_bytes(json.dumps({"ready": True, "port": port}).encode())
    base_url = f"http://127.0.0.1:{port}/v1"
    warm_up(base_url)
    # What is loaded now stays out of the collector's passes: episodes' forks then share
    # these pages instead of each copying what a collection touches.
    gc.collect()
    gc.freeze()
    _serve(conn, fn, base_url, settings["model"])


if __name__ == "__main__":
    main(int(sys.argv[1]))
