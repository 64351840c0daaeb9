"""A worker for the tests of rl.sandbox: `python -m tests.helpers.sandbox_worker FD` says what
it sees of its process, then echoes messages until EOF; "hang" makes it busy forever."""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

from rl.sandbox import connect


def main(fd: int) -> None:
    conn = connect(fd)
    ignores_sigint = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    conn.send((dict(os.environ), resource.getrlimit(resource.RLIMIT_AS), ignores_sigint))
    try:
        while (message := conn.recv()) != "hang":
            conn.send(message)
    except EOFError:
        return
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
