"""The long-sample recipe (recipes/grpo_majority_sp_cpu.yaml) through the real `rl train`: two
steps with trainer.sequence_parallel=2 (both trainer ranks one group, each holding half of
every packed row of samples of 2,000-3,000 tokens) log the metrics of the same two steps with
sequence_parallel=1 (two data-parallel ranks, whole rows), from one base at one seed.

The base is the recipe's, SFT'd on short prompts of its task (63-255 letters: seconds, where
its own SFT on the long ones takes minutes); counting letters carries over to long prompts
well enough that the policy is right on some samples of a group and wrong on others, so the
steps have a gradient to compare."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_rl
from tests.helpers.resumed_steps import computed

pytestmark = pytest.mark.e2e

RECIPE = "recipes/grpo_majority_sp_cpu.yaml"
# fp32 tolerance of a metric of the two runs. Their steps differ in the order of floating-point
# sums only: attention and the projections over half rows against whole rows, the loss's token
# sums gathered from two ranks. One step moves each per-token value by a few float32 epsilons
# (~1e-7 relative), and the second step samples from weights that differ by as much, so the
# engine's log-probs of step 2 differ too. 1e-4 relative leaves room for sums of ~10^4 such
# tokens; what sequence parallelism could get wrong (a position attending across the ranks'
# boundary or to another sample, a slice of the loss counted twice or lost, a gradient not
# summed over the group) moves these metrics by percents. The absolute floor is for the metrics
# that are rounding themselves (actor/approx_kl_old: the trainer's log-probs against the
# engine's of the same weights), where a relative tolerance means nothing.
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """Each degree's metrics records."""
    root = tmp_path_factory.mktemp("sequence-parallel")
    base = root / "base"
    data = f"data.dir={root / 'data'}"
    built = run_rl(
        "build-base",
        RECIPE,
        f"model.path={base}",
        data,
        "data.task_config.min_length=63",
        "data.task_config.max_length=255",
        "data.num_train=2000",
        "data.num_test=20",
        "base.sft_steps=60",
        "base.sft_batch_size=32",
        "base.sft_lr=3e-3",
    )
    assert built.returncode == 0, built.stderr[-4000:]
    results = {}
    for degree in (1, 2):
        name = f"sp{degree}"
        result = run_rl(
            "train",
            RECIPE,
            f"model.path={base}",
            data,
            f"run.output_dir={root / 'runs'}",
            f"run.name={name}",
            f"trainer.sequence_parallel={degree}",
            "data.num_train=64",
            "data.num_test=8",
            "run.num_steps=2",
            "run.prompts_per_step=2",
            "algorithm.group_size=4",
            "run.eval_every=0",
            "run.num_eval_prompts=0",
            "run.export_hf=false",
            "run.wandb_mode=disabled",
            "run.tensorboard=false",
            "checkpoint.save_final=false",
        )
        assert result.returncode == 0, result.stderr[-4000:]
        run_dir = root / "runs" / name
        # What ran is what was asked: the degree as the run resolved it.
        resolved = json.loads((run_dir / "config.json").read_text())
        assert resolved["trainer"]["sequence_parallel"] == degree
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        results[degree] = [json.loads(line) for line in lines]
    return results


def test_a_run_with_sequence_parallelism_logs_the_metrics_of_the_run_without(runs: dict) -> None:
    # The machine's measurements (timings, memory) aside.
    with_sp, without = ([computed(r) for r in runs[degree]] for degree in (2, 1))
    assert [r["step"] for r in with_sp] == [r["step"] for r in without] == [0, 1, 2]
    for record, reference in zip(with_sp, without, strict=True):
        assert record.keys() == reference.keys()
        for key, value in reference.items():
            assert record[key] == pytest.approx(value, rel=RTOL, abs=ATOL, nan_ok=True), key


def test_the_runs_trained_on_long_samples_with_a_gradient(runs: dict) -> None:
    """The agreement above is between steps that trained: samples of thousands of tokens, some
    right and some wrong in a group, a non-zero gradient and a KL to the reference."""
    steps = runs[1][1:]
    for record in steps:
        # Prompt and response tokens trained (2 prompts x 4 samples), from the trainer's rate.
        trained = record["timing/train_tokens_per_s"] * record["timing/train_step_s"]
        assert trained / 8 > 2000
    assert any(0 < record["reward/mean"] < 1 for record in steps)
    assert all(record["actor/grad_norm"] > 0 for record in steps)
    assert steps[-1]["actor/kl_ref"] > 0
