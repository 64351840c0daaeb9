"""SIGTERM and SIGINT: the first stops the run after the current step, with a checkpoint;
the second exits at once (checkpoints are renamed into place whole, so none is damaged),
taking the processes of the local Ray cluster the driver started with it."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is not None:
            print(f"second {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            _kill_descendants()
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        print(
            f"{self.signal_name}: finishing the current step, then writing a checkpoint "
            "(signal again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> None:
        """Handle the signals from now on. Called again after `ray.init`, whose core worker
        puts in handlers of its own that abort the process on SIGTERM."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle the signals while the block runs (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        self.install()
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _kill_descendants() -> None:
    """SIGKILL every process this one started, however deep. Exiting at once skips Ray's
    shutdown; its raylet and actors die with their parent, but its dashboard and runtime-env
    agents would outlive it. A joined cluster's processes are not our descendants."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:  # exited meanwhile
            pass
