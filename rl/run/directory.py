"""A run's directory: a new run never writes into another run's, and one live process at a
time writes each.

`rl train` without `--resume` whose `run.name` already has a non-empty directory (an earlier
run's metrics, checkpoints, export) leaves it alone and runs as NAME-2 (the next free number),
saying so; `--resume` continues the directory of `run.name` exactly. While a run is alive its
driver holds an exclusive lock on RUN_DIR/.lock (flock: the kernel drops it when the process
dies, however it dies), and a second process on the same directory is refused, naming the
first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from rl.config import Config


class RunInUse(RuntimeError):
    """Another live process is writing this run's directory."""


def fresh_run_config(cfg: Config, resuming: bool) -> Config:
    """`cfg`, or (a new run whose directory holds an earlier run) `cfg` with run.name moved
    on to the first NAME-k, k >= 2, whose directory is missing or empty."""
    if resuming or not _holds_a_run(cfg.run.directory()):
        return cfg
    parent, name = Path(cfg.run.output_dir), cfg.run.name
    k = 2
    while _holds_a_run(parent / f"{name}-{k}"):
        k += 1
    run = cfg.run.model_copy(update={"name": f"{name}-{k}"})
    return cfg.model_copy(update={"run": run})


def _holds_a_run(path: Path) -> bool:
    """Whether a run wrote anything here (its lock alone is no result)."""
    return path.is_dir() and any(entry.name != ".lock" for entry in path.iterdir())


class RunLock:
    """The exclusive right to write one run directory, for as long as the `with` block runs."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunInUse(
                f"{self.path.parent} is being written by a live run (pid {holder}); wait for it "
                "to finish or stop it, or give this run another run.name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        os.close(self._fd)  # releases the lock
        self._fd = None
