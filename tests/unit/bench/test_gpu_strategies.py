"""bench/gpu_strategies.py runs every strategy end to end (a tiny shape, on CPU here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.repo import REPO
from tests.unit.bench.bench_modules import load_bench_module

pytestmark = pytest.mark.integration  # real PolicyTrainers, a process group each

gpu_strategies = load_bench_module("gpu_strategies")


def test_the_tiny_run_reports_every_strategy() -> None:
    result = subprocess.run(
        [sys.executable, "bench/gpu_strategies.py", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    labels = [*gpu_strategies.STRATEGIES, gpu_strategies.RELEASED]
    assert [row.split(" | ")[0][2:] for row in rows] == labels
    for row in rows:
        seconds, peak = row.strip(" |").split(" | ")[1:3]
        assert float(seconds) > 0 and float(peak.replace(",", "")) > 0
    # On CPU the release has nothing to move: the run is the plain zero3 one, to the bit.
    assert "(relative difference 0.0e+00)" in result.stdout
