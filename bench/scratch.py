"""The benchmarks' own runs: each starts from an empty directory under its own run.name.

`rl train` never writes into an earlier run's directory (a new run moves on to NAME-2), so a
benchmark that runs a recipe again under the same name clears that directory first: it is
the benchmark's scratch, and what it measured lives in docs/benchmarks.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rl.config import Config


def clear_run(cfg: Config) -> Path:
    """Delete the run directory `cfg` names (a benchmark's own run) and return its path."""
    run_dir = cfg.run.directory()
    assert any(part.startswith("bench-") for part in run_dir.parts), (
        f"{run_dir} is not a benchmark's run directory"
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir
