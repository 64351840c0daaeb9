"""Peak memory of this process over a window of work: resident memory from /proc (Linux), or
CUDA's allocator when the process uses a GPU.

Two kinds of window share the kernel's one peak counter (VmHWM): short ones that
`reset_peak_rss` opens and `peak_rss_bytes` reads (a train step, a weight sync), and the long
ones between calls of `take_peak_rss_bytes` (a whole step, reported per step). A reset folds
the peak it clears into the long window, so the short windows do not shorten it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

# The largest peak `reset_peak_rss` cleared since the last `take_peak_rss_bytes`.
_folded_peak_bytes = 0


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


def _clear_peak() -> None:
    """The kernel sets the peak to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def reset_peak_rss() -> None:
    """Start a new short peak window (the peak so far still counts for the long one)."""
    global _folded_peak_bytes
    _folded_peak_bytes = max(_folded_peak_bytes, peak_rss_bytes())
    _clear_peak()


def take_peak_rss_bytes() -> int:
    """The largest resident set size since the previous take (or the process start), short
    windows in between included; starts the next long window. Call it outside short windows:
    it clears the peak they read."""
    global _folded_peak_bytes
    peak = max(_folded_peak_bytes, peak_rss_bytes())
    _folded_peak_bytes = 0
    _clear_peak()
    return peak


def take_peak_memory_bytes() -> int:
    """`take_peak_rss_bytes`, or in a process that uses CUDA the allocator's peak on the
    current device since the previous take (the device memory is what runs out there)."""
    if torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak
    return take_peak_rss_bytes()


def reuse_freed_host_memory() -> bool:
    """Make glibc keep the memory of freed tensors in this process for the next ones; returns
    whether it applied (False where the C library is not glibc).

    By default glibc gives an allocation of a few MiB (an activation of a CPU micro-batch)
    pages of its own and hands them back to the kernel when it is freed, then raises those
    limits as it goes; a train step's mix of sizes kept it mapping and page-faulting its
    activations in afresh every micro-batch. Allocations up to 32 MiB now come from the heap,
    which keeps up to 256 MiB free at its top instead of trimming it (its effect on the train
    step: docs/benchmarks.md).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    )
