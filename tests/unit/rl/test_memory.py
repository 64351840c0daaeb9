"""rl.memory on this process's real /proc: short peak windows (reset_peak_rss .. peak_rss_bytes)
inside the long ones between takes, as a weight sync runs inside a rollout worker's step."""

from __future__ import annotations

import torch

from rl.memory import (
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    take_peak_memory_bytes,
    take_peak_rss_bytes,
)

MIB = 1 << 20
SIZE = 128 * MIB  # well above glibc's mmap threshold: freeing it shrinks the RSS again


def _touch_and_free() -> None:
    """Raise the resident peak by SIZE, then drop back (b"\\xff" * n writes every page:
    zeroed memory from calloc would not be resident)."""
    blob = b"\xff" * SIZE
    assert len(blob) == SIZE
    del blob


def test_a_reset_inside_the_window_does_not_hide_its_peak_from_the_take() -> None:
    take_peak_rss_bytes()  # start a window
    base = rss_bytes()
    _touch_and_free()
    reset_peak_rss()  # as a weight sync's first bucket does
    # The short window starts after the allocation: the sync's own peak stays its own.
    assert peak_rss_bytes() < base + SIZE // 2
    assert take_peak_rss_bytes() >= base + SIZE - 8 * MIB
    # The take started a new window: the allocation belongs to the previous one.
    assert take_peak_rss_bytes() < base + SIZE // 2


def test_a_take_without_resets_sees_the_peak_and_cuda_free_processes_use_rss() -> None:
    assert not torch.cuda.is_initialized()
    take_peak_memory_bytes()
    base = rss_bytes()
    _touch_and_free()
    assert take_peak_memory_bytes() >= base + SIZE - 8 * MIB
    assert take_peak_memory_bytes() < base + SIZE // 2
