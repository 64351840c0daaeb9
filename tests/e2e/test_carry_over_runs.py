"""partial_rollout carry through the real `rl` command: a run killed with SIGKILL while it
generates, then resumed with `--resume auto`, logs the reference run's metrics bit for bit
(measurements of the machine aside): the steps before the kill from one process and the rest
from another, each timed differently from the reference, with carried samples and the backlog
of finished groups in the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.checkpoint.store import list_checkpoints
from tests.helpers.recipe_runs import kill_after_step, reference_run, run_recipe, write_recipe
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base

pytestmark = pytest.mark.e2e

NUM_STEPS = 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> Path:
    """A tiny GRPO recipe whose samples stop every 2 tokens, so that most groups finish in a
    later epoch than they started and every checkpoint holds partial samples."""
    root = with_tiny_base(tmp_path_factory.mktemp("carry"), tiny_base)
    tree = tiny_run_tree(
        root,
        root / "runs",
        "reference",
        checkpoint={"every": 2},
        run={"num_steps": NUM_STEPS, "eval_every": 2, "export_hf": False},
        scheduler={"max_staleness": 1, "partial_rollout": "carry", "abort_every": 2},
    )
    return write_recipe(root, tree)


@pytest.fixture(scope="module")
def reference(recipe: Path) -> list[dict]:
    return reference_run(recipe, NUM_STEPS)


def test_a_carry_run_carries_groups_over_within_its_bounds(reference: list[dict]) -> None:
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
    kill_after_step(recipe, name, 3)
    checkpoints = recipe.parent / "runs" / name / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_000002"]
    assert run_recipe(recipe, name, "--resume", "auto") == reference
