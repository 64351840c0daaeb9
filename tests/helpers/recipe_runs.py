"""`rl train` runs of a recipe written under a test's directory (runs land in its runs/), as
the e2e replay and resume tests make them: a run's metrics records, and a run killed with
SIGKILL once it has logged a step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.helpers.cli import run_rl
from tests.helpers.repo import REPO
from tests.helpers.resumed_steps import computed


def write_recipe(root: Path, tree: dict) -> Path:
    """`tree` as root/recipe.yaml; its runs go to root/runs (tiny_run_tree's output_dir)."""
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def records(recipe: Path, name: str) -> list[dict]:
    """Run `name`'s metrics records so far (none before its first)."""
    path = recipe.parent / "runs" / name / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_recipe(recipe: Path, name: str, *extra: str) -> list[dict]:
    """`rl train recipe run.name=name *extra` to its end; its records without the machine's
    measurements (`computed`), what two runs must agree on bit for bit."""
    result = run_rl("train", str(recipe), f"run.name={name}", *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    return [computed(record) for record in records(recipe, name)]


def reference_run(recipe: Path, num_steps: int) -> list[dict]:
    """The run "reference" of `recipe` (`run_recipe`), checked to log steps 0..num_steps."""
    logged = run_recipe(recipe, "reference")
    assert [r["step"] for r in logged] == list(range(num_steps + 1))
    return logged


def kill_after_step(recipe: Path, name: str, step: int, timeout_s: float = 600) -> None:
    """Start run `name` and SIGKILL it, with the Ray processes it started, once it has logged
    step `step`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "train", str(recipe), f"run.name={name}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the kill reaches the Ray processes it started
    )
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in records(recipe, name)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
