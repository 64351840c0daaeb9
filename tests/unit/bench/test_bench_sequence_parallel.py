"""bench/sequence_parallel.py: the allocator peak it reads from the profiler, and the search for
the longest sample within a budget."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.unit.bench.bench_modules import load_bench_module

bench = load_bench_module("sequence_parallel")
MIB = 2**20


def test_the_allocated_peak_is_the_most_allocated_in_the_window_live_at_once() -> None:
    before = torch.empty(4 * MIB, dtype=torch.uint8)  # live when the window opens: not counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a
        c = torch.empty(MIB // 2, dtype=torch.uint8)
    assert bench.allocated_peak(prof) == 3 * MIB  # a and b
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        d = torch.empty(MIB, dtype=torch.uint8)
        del before  # the profiler never saw it allocated, so it does not see it freed
        e = torch.empty(MIB, dtype=torch.uint8)
    # d and e: an upper bound of the rise (which here is 2 - 4 MiB below the start).
    assert bench.allocated_peak(prof) == 2 * MIB
    del b, c, d, e


def _fake_measurements(monkeypatch: pytest.MonkeyPatch, peak_of) -> list[int]:
    """`bench.measure` replaced by `peak_of(length)`; the lengths it is asked for, in order."""
    asked = []

    def measure(model_dir, sp: int, length: int) -> dict:
        asked.append(length)
        return {"allocated": peak_of(length)}

    monkeypatch.setattr(bench, "measure", measure)
    return asked


@pytest.mark.parametrize(
    "peak_of",
    [
        lambda n: 5 * MIB + 50_000 * n,  # linear, as measured
        lambda n: 5 * MIB + 20_000 * n + n * n,  # convex: the line's guesses fall short
        lambda n: 80 * MIB + 10_000 * n,  # mostly fixed
    ],
)
@pytest.mark.parametrize("budget_mib", [100, 400, 1024])
def test_the_search_finds_the_longest_length_that_fits(monkeypatch, peak_of, budget_mib) -> None:
    step, budget = 1024, budget_mib * MIB
    asked = _fake_measurements(monkeypatch, peak_of)
    longest, runs = bench.longest_within(None, 2, budget, step, {})
    # Every multiple of step in turn (the peaks grow with the length).
    expected = 0
    while peak_of(expected + step) <= budget:
        expected += step
    assert longest == expected
    # The answer rests on its own measurement and the next length's.
    assert runs[longest]["allocated"] <= budget < runs[longest + step]["allocated"]
    assert len(asked) == len(set(asked)) <= 12  # each length once, and few of them


def test_the_search_starts_from_what_was_measured(monkeypatch) -> None:
    asked = _fake_measurements(monkeypatch, lambda n: 1_000 * n)
    known = {16384: {"allocated": 16_384_000}}
    longest, runs = bench.longest_within(None, 1, 10_240_000, 1024, known)
    assert longest == 10240
    assert 16384 not in asked and runs[16384] == known[16384]


def test_a_budget_below_the_shortest_length_fits_nothing(monkeypatch) -> None:
    _fake_measurements(monkeypatch, lambda n: 100 * MIB + n)
    assert bench.longest_within(None, 2, 50 * MIB, 1024, {})[0] == 0


def test_packed_samples_share_half_of_the_tokens_beside_a_sample_of_the_other_half() -> None:
    assert bench.sample_lengths(16384, 0) == [16384]
    assert bench.sample_lengths(16384, 8) == [8192] + [1024] * 8
    assert bench.sample_lengths(100, 3) == [50, 17, 17, 16]
    batch = bench.samples([6, 3], vocab_size=10)
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    # The response (after the prompt: half of a short sample) is what the loss covers.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 0, 0, 0]]
