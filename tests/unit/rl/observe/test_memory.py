"""rl.observe.memory on this process's real /proc: short peak windows (reset_peak_rss .. peak_rss_bytes)
inside the long ones between takes, as a weight sync runs inside a rollout worker's step."""

from __future__ import annotations

import resource
import subprocess
import sys

import torch

from rl.observe.memory import (
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    take_peak_memory_bytes,
    take_peak_rss_bytes,
)
from tests.helpers.repo import REPO

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


# Page faults of 100 forward/backward steps of an MLP of the time-to-accuracy model's width
# (1,000 tokens, 128 -> 1024 -> 128), after 30 to warm up: activations of 0.5-4 MiB. The heap
# still grows now and then over the first steps (a few 1,000-fault steps in the first 30), so
# a short window after a short warm-up measured 1,000 or 2,001 faults from run to run.
TOKENS, WIDTH, HIDDEN = 1000, 128, 1024
_COUNT_FAULTS = f"""
import resource, sys, torch
from rl.observe.memory import reuse_freed_host_memory
torch.set_num_threads(1)
if sys.argv[1] == "reuse":
    assert reuse_freed_host_memory()
mlp = torch.nn.Sequential(
    torch.nn.Linear({WIDTH}, {HIDDEN}), torch.nn.SiLU(), torch.nn.Linear({HIDDEN}, {WIDTH})
)
x = torch.randn({TOKENS}, {WIDTH})
for step in range(130):
    if step == 30:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    mlp(x).square().sum().backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

# The pages of one step's activations and their gradients, fp32: the forward's outputs
# (Linear 1, SiLU, Linear 2, square) and a gradient of each shape in the backward. A heap that
# keeps freed memory grows to hold one step's working set and then reuses it, so 100 steps
# fault in at most about this many pages (the growths the first steps left undone); a heap
# that hands freed pages back faults them in again step after step, a multiple of it.
STEP_PAGES = 2 * (2 * TOKENS * HIDDEN + 2 * TOKENS * WIDTH) * 4 // resource.getpagesize()


def _page_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_FAULTS, mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def test_reusing_freed_host_memory_stops_steps_page_faulting_their_activations_in() -> None:
    """Each step's activations come back from the heap instead of fresh pages. Each mode is
    held to the one step's working set, not to the other mode's count, so neither run's noise
    moves the other's bar (measured over nine runs: 0 to 1,872 faults with reuse, 29,617 to
    53,282 without, against 4,500 pages a step)."""
    reused = _page_faults("reuse")
    assert reused < STEP_PAGES, f"{reused} faults in 100 steps: steps fault their memory in"
    # The control: without reuse the same steps fault in more than twice a working set, so
    # the bound above is one that the default allocator fails.
    default = _page_faults("default")
    assert default > 2 * STEP_PAGES, f"the control faulted only {default} pages"
