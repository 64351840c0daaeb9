"""bench/gpu_strategies.py runs every strategy end to end (a tiny shape, on CPU here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
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
    assert [row.split(" | ")[0][2:] for row in rows] == list(gpu_strategies.STRATEGIES)
    for row in rows:
        seconds, peak = row.strip(" |").split(" | ")[1:]
        assert float(seconds) > 0 and float(peak.replace(",", "")) > 0
