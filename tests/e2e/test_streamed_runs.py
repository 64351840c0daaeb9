"""scheduler.streaming through the real `rl` command: a streamed run killed with SIGKILL while
chunks of a step are in the trainer's gradients (not checkpointed) and resumed with
`--resume auto` logs the reference run's metrics bit for bit (the steps before the kill from
one process, the rest from another, each timed differently from the reference); and its first
step is the unstreamed run's to fp32 rounding."""

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
    """A tiny GRPO recipe at max_staleness 1 with the trainer streaming (the default chunk: 2
    of a step's 8 groups), and a proximal pass (decoupled PPO), so every streamed chunk is
    annotated as well."""
    root = with_tiny_base(tmp_path_factory.mktemp("streamed"), tiny_base)
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
    return write_recipe(root, tree)


@pytest.fixture(scope="module")
def reference(recipe: Path) -> list[dict]:
    return reference_run(recipe, NUM_STEPS)


def test_the_streamed_steps_have_gradients_before_and_after_the_resume_point(
    reference: list[dict],
) -> None:
    # The kill below compares steps with a gradient, after its resume point too (a step whose
    # groups all score alike has none).
    assert reference[1]["actor/grad_norm"] > 0
    assert any(record["actor/grad_norm"] > 0 for record in reference[3:])


def test_a_streamed_step_is_the_whole_batchs_step_to_rounding(
    recipe: Path, reference: list[dict]
) -> None:
    """Step 1 trains the same samples from the same weights either way: its gradient is the
    same sum, accumulated chunk by chunk and divided last."""
    whole = run_recipe(recipe, "whole", "scheduler.streaming=false", "run.num_steps=1")
    streamed, unstreamed = reference[1], whole[1]
    assert streamed["rollout/tokens"] == unstreamed["rollout/tokens"]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert streamed[key] == pytest.approx(unstreamed[key], rel=1e-4, abs=1e-7), key


def test_a_streamed_run_killed_mid_step_resumes_bit_for_bit(
    recipe: Path, reference: list[dict]
) -> None:
    name = "killed"
    kill_after_step(recipe, name, 3)  # step 4's chunks stream into the trainer meanwhile
    checkpoints = recipe.parent / "runs" / name / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_000002"]
    assert run_recipe(recipe, name, "--resume", "auto") == reference
