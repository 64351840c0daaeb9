"""An agent function (`agent.environment: openai:...`) through the real `rl` command: its
episodes pause at every sync's abort point mid-turn and resume by running the agent again,
answered from the record; a run killed with SIGKILL after a step and resumed with `--resume
auto`, whose episodes in flight (their calls in the checkpoint) resume the same way, logs the
uninterrupted run's metrics bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.metric_keys import check_metric_keys
from tests.helpers.recipe_runs import kill_after_step, reference_run, run_recipe, write_recipe
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base

pytestmark = pytest.mark.e2e

NUM_STEPS = 4
AGENT = Path(__file__).with_name("agent_functions.py")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> Path:
    """The tiny runs' base (a single-turn recipe's: an agent function has no demonstrations),
    trained through the agent at max_staleness 1 with abort points."""
    root = with_tiny_base(tmp_path_factory.mktemp("agent-function"), tiny_base)
    tree = tiny_run_tree(
        root,
        root / "runs",
        "reference",
        base={"build_if_missing": False},
        agent={"environment": f"openai:{AGENT}:ask_twice", "max_turns": 2, "env_workers": 1},
        rollout={"max_new_tokens": 40},
        checkpoint={"every": 2},
        run={"num_steps": NUM_STEPS, "eval_every": 0, "export_hf": False},
        scheduler={"max_staleness": 1, "partial_rollout": "abort", "abort_every": 4},
        trainer={"lr": 1e-3},
    )
    return write_recipe(root, tree)


@pytest.fixture(scope="module")
def reference(recipe: Path) -> list[dict]:
    return reference_run(recipe, NUM_STEPS)


def test_an_agent_function_run_pauses_its_episodes_and_trains(reference: list[dict]) -> None:
    check_metric_keys(reference)
    for record in reference[1:]:
        assert record["agent/turns_mean"] == 2.0  # both calls answered, one sequence
        assert record["agent/segments_per_episode"] == 1.0
        assert record["agent/env_failures"] == 0 and record["agent/replay_mismatches"] == 0
    # Episodes were paused at abort points and resumed (their agents run again) ...
    assert any(record["rollout/resumed_samples"] > 0 for record in reference[1:])
    # ... and the steps after the resume point had a gradient to get right.
    assert any(record["actor/grad_norm"] > 0 for record in reference[3:])


def test_an_agent_function_run_killed_after_a_step_resumes_bit_for_bit(
    recipe: Path, reference: list[dict]
) -> None:
    name = "killed"
    kill_after_step(recipe, name, 3)
    assert run_recipe(recipe, name, "--resume", "auto") == reference
