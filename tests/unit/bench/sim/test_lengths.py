"""bench/sim/lengths.py: long-tailed lengths fixed by a sample's ids, and a trace of lengths
read as untrusted input."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from rl.types import Sample
from tests.unit.bench.bench_modules import bench_import

lengths = bench_import("sim.lengths")


def sample(group_id: int, index: int) -> Sample:
    return Sample(prompt_ids=[1], group_id=group_id, index=index)


def test_log_normal_lengths_have_the_median_and_tail_of_the_distribution() -> None:
    draw = lengths.LogNormal(median=2000, sigma=1.0, cap=10**9)
    drawn = [draw(sample(g, i)) for g in range(2000) for i in range(8)]
    assert statistics.median(drawn) == pytest.approx(2000, rel=0.05)
    # P(length > e x median) = P(z > 1) = 0.1587 for a standard normal z.
    beyond = sum(n > math.e * 2000 for n in drawn) / len(drawn)
    assert beyond == pytest.approx(0.1587, abs=0.01)
    assert draw(sample(7, 3)) == draw(sample(7, 3))  # fixed by the ids


def test_lengths_stop_at_the_cap() -> None:
    draw = lengths.LogNormal(median=2000, sigma=1.0, cap=8000)
    drawn = [draw(sample(g, 0)) for g in range(3000)]
    assert max(drawn) == 8000
    # P(z > ln 4) = 0.0827: those stop at the cap.
    assert sum(n == 8000 for n in drawn) / len(drawn) == pytest.approx(0.0827, abs=0.015)


def test_a_trace_is_replayed_in_order_of_group_then_index(tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths of a run\n120\n\n4000  # a long one\n75\n")
    replay = lengths.Replay(lengths.read_lengths(path), group_size=2, cap=1000)
    assert [replay(sample(g, i)) for g in range(3) for i in range(2)] == [
        120,
        1000,
        75,
        120,
        1000,
        75,
    ]


@pytest.mark.parametrize(
    ("text", "bad"), [("10\n-3\n", "2: expected a positive token count, got '-3'"),
                      ("10\n1.5\n", "2: expected a positive token count, got '1.5'"),
                      ("7\n\n0\n", "3: expected a positive token count, got '0'"),
                      ("# nothing\n", "no response lengths in it")],
)  # fmt: skip
def test_a_bad_trace_is_refused_naming_its_file_and_line(
    tmp_path: Path, text: str, bad: str
) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        lengths.read_lengths(path)
    assert str(error.value).startswith(str(path)) and bad in str(error.value)
