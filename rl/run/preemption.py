"""SIGTERM and SIGINT: the first stops the run after the current step, with a checkpoint;
the second exits at once (checkpoints are renamed into place whole, so none is damaged),
taking the processes of the local Ray cluster the driver started with it.

Signals are counted by a watcher thread reading Python's wakeup fd, not by a Python-level
handler: CPython runs handlers only when the main thread returns to the interpreter, and
signals that arrive meanwhile (the main thread blocked in `ray.get` or a long torch op)
coalesce into one call, so a quick second Ctrl-C would be lost. The wakeup fd gets one byte
per signal, and the watcher acts on it whatever the main thread is doing."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: the watcher thread acts on the signal (see the module doc);
    installing a handler is what makes CPython write the signal to the wakeup fd."""


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._write_fd: int | None = None

    def _on_signal(self, signum: int) -> None:
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

    def _on_late_signal(self, signum: int, frame: object) -> None:
        self._on_signal(signum)

    def _watch(self, read_fd: int) -> None:
        """Act on each signal number written to the wakeup fd, until its write end closes."""
        while data := os.read(read_fd, 64):
            for signum in data:
                if signum in SIGNALS:
                    self._on_signal(signum)
        os.close(read_fd)

    def install(self) -> int:
        """Handle the signals from now on (inside `installed`); returns the wakeup fd it
        replaced (-1: none). Called again after `ray.init`, whose core worker puts in
        handlers of its own that abort the process on SIGTERM."""
        if self._write_fd is None:
            return -1
        for sig in SIGNALS:
            signal.signal(sig, _ignore)
        return signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle the signals while the block runs (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C-level handler must never block
        watcher = threading.Thread(target=self._watch, args=(read_fd,), daemon=True)
        watcher.start()
        previous_fd = self.install()
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                # After a stop request the process is on its way out (its shutdown can end
                # before a user's second Ctrl-C lands): a later signal must still exit at once,
                # taking whatever this process started with it.
                signal.signal(sig, handler if self.signal_name is None else self._on_late_signal)
            signal.set_wakeup_fd(previous_fd)
            os.close(self._write_fd)  # the watcher reads EOF and ends
            self._write_fd = None
            watcher.join()


def _kill_descendants() -> None:
    """SIGKILL every process this one started, however deep. Exiting at once skips Ray's
    shutdown; its raylet and actors die with their parent, but its dashboard and runtime-env
    agents would outlive it. A joined cluster's processes are not our descendants."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:  # exited meanwhile
            pass
