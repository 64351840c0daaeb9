"""Free TCP ports for the rendezvous stores and Ray daemons that tests start."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the kernel just handed out. All sockets stay bound until every
    port is chosen, so no two are the same; a port is never derived as `port + i`, which
    another process may hold."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port() -> int:
    return free_ports(1)[0]
