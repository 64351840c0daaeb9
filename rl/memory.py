"""Resident memory of this process, from /proc (Linux): peak tracking over a window of work."""

from __future__ import annotations

from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size now (anonymous, file and shared-memory pages)."""
    return _status_kib("VmRSS") << 10


def peak_rss_bytes() -> int:
    """The largest resident set size since the process started or `reset_peak_rss`."""
    return _status_kib("VmHWM") << 10


def reset_peak_rss() -> None:
    """Start a new peak window: the kernel sets the peak to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
