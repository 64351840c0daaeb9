"""Waiting on a condition instead of sleeping for a guessed time: the deadline is a hang
guard, far above how long the condition normally takes, so a busy machine only makes the
wait longer, never the test wrong."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

HANG_GUARD_S = 60.0


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = HANG_GUARD_S) -> None:
    """Return once `condition()` is true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.01)


def signal_pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig`, sent to process `pid` with kill(2), is still waiting to be delivered
    (the process-wide pending set, ShdPnd in /proc/PID/status). Standard signals do not
    queue: one sent while the same one is pending merges into it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise RuntimeError(f"/proc/{pid}/status has no ShdPnd")


def wait_until_delivered(pid: int, sig: signal.Signals) -> None:
    """Return once the `sig` sent to `pid` has been delivered, so that sending it again
    counts as a second signal rather than merging into the first."""
    wait_until(lambda: not signal_pending(pid, sig), f"delivery of {sig.name} to {pid}")


def main_thread_cpu_ticks(pid: int) -> int:
    """CPU time (user + system, in clock ticks) that process `pid`'s main thread has used."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on: utime is field 14
    return int(fields[11]) + int(fields[12])
