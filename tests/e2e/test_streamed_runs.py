"""scheduler.streaming through the real `rl` command: two streamed runs whose timings differ log
the same metrics bit for bit; a streamed run killed with SIGKILL while groups of a step are in
the trainer's gradients (not checkpointed) and resumed with `--resume auto` logs them too; and
its first step is the unstreamed run's to fp32 rounding."""

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

NUM_STEPS = 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GRPO recipe at max_staleness 1 with the trainer streaming, and a critic-free
    proximal pass (decoupled PPO), so every streamed group is annotated as well."""
    root = tmp_path_factory.mktemp("streamed")
    tree = tiny_run_tree(
        root,
        root / "runs",
        "reference",
        checkpoint={"every": 2},
        run={"num_steps": NUM_STEPS, "eval_every": 0, "export_hf": False},
        scheduler={"max_staleness": 1, "streaming": True},
        # Slower than the tiny runs' 1e-2, which collapses the tiny policy within 3 steps:
        # every step after the resume point must still have a gradient to get right.
        trainer={"lr": 1e-3},
        algorithm={"off_policy": "decoupled", "recompute_old_logprobs": True},
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


def test_two_streamed_runs_log_the_same_metrics(recipe: Path, reference: list[dict]) -> None:
    assert _run(recipe, "again") == reference
    # Steps with a gradient, after the resume point of the kill below too (a step whose
    # groups all score alike has none).
    assert reference[1]["actor/grad_norm"] > 0
    assert any(record["actor/grad_norm"] > 0 for record in reference[3:])


def test_a_streamed_step_is_the_whole_batchs_step_to_rounding(
    recipe: Path, reference: list[dict]
) -> None:
    """Step 1 trains the same samples from the same weights either way: its gradient is the
    same sum, accumulated group by group and divided last."""
    whole = _run(recipe, "whole", "scheduler.streaming=false", "run.num_steps=1")
    streamed, unstreamed = reference[1], whole[1]
    assert streamed["rollout/tokens"] == unstreamed["rollout/tokens"]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert streamed[key] == pytest.approx(unstreamed[key], rel=1e-4, abs=1e-7), key


def test_a_streamed_run_killed_mid_step_resumes_bit_for_bit(
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
    # After step 3 is logged, step 4's groups stream into the trainer as they finish.
    while not any(r["step"] >= 3 for r in _records(recipe, name)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 3 never came"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    checkpoints = recipe.parent / "runs" / name / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_000002"]
    assert _run(recipe, name, "--resume", "auto") == reference
