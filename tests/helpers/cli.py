"""The `rl` command line run as a user runs it: a subprocess in the repository."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.repo import REPO


def run_rl(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """`rl ARGS...` in a fresh interpreter from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rl.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
