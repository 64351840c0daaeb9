"""partial_rollout carry through the real `rl` command: two runs whose timings differ log the
same metrics, and a run killed with SIGKILL while it generates, then resumed with
`--resume auto`, logs them too, bit for bit (measurements of the machine aside), carried
samples and the backlog of finished groups included in its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rl.checkpoint.store import list_checkpoints
from tests.helpers.cli import run_rl
from tests.helpers.repo import REPO
from tests.helpers.resumed_steps import computed
from tests.helpers.tiny_runs import tiny_run_tree

pytestmark = pytest.mark.e2e

NUM_STEPS = 5


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GRPO recipe whose samples stop every 2 tokens, so that most groups finish in a
    later epoch than they started and every checkpoint holds partial samples."""
    root = tmp_path_factory.mktemp("carry")
    tree = tiny_run_tree(
        root,
        root / "runs",
        "reference",
        checkpoint={"every": 2},
        run={"num_steps": NUM_STEPS, "eval_every": 2, "export_hf": False},
        scheduler={"max_staleness": 1, "partial_rollout": "carry", "abort_every": 2},
    )
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _records(recipe: Path, name: str) -> list[dict]:
    path = recipe.parent / "runs" / name / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(recipe: Path, name: str, *extra: str) -> list[dict]:
    result = run_rl("train", str(recipe), f"run.name={name}", *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    return [computed(record) for record in _records(recipe, name)]


@pytest.fixture(scope="module")
def reference(recipe: Path) -> list[dict]:
    records = _run(recipe, "reference")
    assert [r["step"] for r in records] == list(range(NUM_STEPS + 1))
    return records


def test_two_carry_runs_log_the_same_metrics_and_carry_groups_over(
    recipe: Path, reference: list[dict]
) -> None:
    assert _run(recipe, "again") == reference
    steps = reference[1:]
    # Carried over: groups that finished an epoch after they started, tokens a version old.
    assert any(r["carry/carried_groups"] > 0 for r in steps)
    assert max(r["carry/max_token_age"] for r in steps) >= 1
    for record in steps:
        assert record["carry/max_token_age"] <= 4  # the default max_token_age
        assert record["carry/stale_token_share"] <= 0.5  # the default max_stale_share


def test_a_carry_run_killed_while_generating_resumes_bit_for_bit(
    recipe: Path, reference: list[dict]
) -> None:
    name = "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "train", str(recipe), f"run.name={name}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the kill reaches the Ray processes it started
    )
    deadline = time.monotonic() + 600
    while not any(r["step"] >= 3 for r in _records(recipe, name)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 3 never came"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    checkpoints = recipe.parent / "runs" / name / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_000002"]
    assert _run(recipe, name, "--resume", "auto") == reference
