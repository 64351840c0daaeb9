"""The agent recipe end to end, with fewer steps: its base built from tool-use demonstrations,
multi-turn GRPO with the sandboxed python tool while the next step's episodes overlap training
(aborted at each sync and resumed), then `rl generate` and `rl eval` running episodes, and
the same base trained with partial_rollout carry (episodes stopped mid-turn, carried over)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.cli import run_rl
from tests.helpers.metric_keys import check_metric_keys

pytestmark = pytest.mark.e2e

RECIPE = "recipes/agent_calculator_cpu.yaml"


def test_agent_recipe_builds_its_base_trains_with_tools_and_evaluates_episodes(
    tmp_path: Path,
) -> None:
    overrides = [
        f"model.path={tmp_path / 'base'}",
        f"data.dir={tmp_path / 'data'}",
        f"run.output_dir={tmp_path / 'runs'}",
        # The recipe's base build as is: it stops at 30% validation success (about 225 steps).
        "data.num_train=3000",
        # The base's and `rl eval`'s held-out episodes (multi-turn, with the sandboxed tool).
        "data.num_test=100",
        "run.num_steps=3",
        "run.prompts_per_step=8",
        "run.eval_every=3",
        "run.num_eval_prompts=16",
        "run.wandb_mode=disabled",
        "run.tensorboard=false",
        "scheduler.max_staleness=1",
        "scheduler.partial_rollout=abort",
        "trainer.micro_batch_size=32",
    ]
    dry = run_rl("train", RECIPE, "--dry-run", *overrides)
    assert dry.returncode == 0, dry.stderr[-4000:]
    assert "agent: environment calculator, tools python (hermes calls)" in dry.stdout

    result = run_rl("train", RECIPE, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    base_info = json.loads((tmp_path / "base" / "base_info.json").read_text())
    # The base answers through the tool part of the time: SFT stopped early, RL has headroom.
    assert 0.3 <= base_info["sft_val_accuracy"] < 1.0
    assert base_info["agent"]["environment"] == "calculator"

    run_dir = tmp_path / "runs" / "agent-calculator"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    check_metric_keys(records)  # the agent/* keys too are in docs/metrics.md
    for record in records[1:]:
        # Episodes called the tool, read its result (masked out of the loss) and answered.
        assert record["agent/tool_calls_mean"] > 0.5
        assert record["agent/turns_mean"] > 1.5
        assert 0 < record["agent/masked_token_frac"] < 1
        assert record["agent/tool_latency_s"] > 0
        assert record["reward/mean"] > 0
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 3]
    # Overlapped: the episodes generating while step 1 trained waited for its weights.
    assert max(r["rollout/staleness_max"] for r in records[1:]) <= 1

    exported = run_dir / "hf"
    generated = run_rl(
        "generate", str(exported), "1234567+7654321", "--environment", "calculator",
        "--engine", "torch", "--max-new-tokens", "96", "--temperature", "0",
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-4000:]
    # The transcript marks the tool's output as inserted, not sampled.
    assert "observation '<|user|><tool_response>" in generated.stdout, generated.stdout
    assert "sampled     '<tool_call>" in generated.stdout, generated.stdout

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}", "answer": str(a + b).zfill(8)}) + "\n"
            for a, b in [(1234567, 7654321), (5550001, 1000999), (8000000, 1999999)]
        )
    )
    # The base's held-out accuracy, measured by the base builder's transformers greedy
    # episodes, reproduced by the torch engine's episodes in `rl eval` (the environment comes
    # from what the base records), within a prompt or two of near-tied logits.
    test_file = next((tmp_path / "data").glob("addition-*/test.jsonl"))
    base = run_rl("eval", str(tmp_path / "base"), "--data", str(test_file), "--engine", "torch",
               "--max-new-tokens", "96")  # fmt: skip
    assert base.returncode == 0, base.stderr[-4000:]
    found = re.search(r"greedy accuracy ([\d.]+)% over (\d+) prompts", base.stdout)
    assert int(found[2]) == base_info["num_test"]
    assert abs(float(found[1]) / 100 - base_info["greedy_accuracy"]) <= 2 / base_info["num_test"]

    report = run_rl("report", str(run_dir))
    assert report.returncode == 0, report.stderr[-4000:]
    assert (run_dir / "report" / "agent.png").stat().st_size > 0
    assert "| turns per episode |" in (run_dir / "report" / "summary.md").read_text()

    # The environment comes from what the checkpoint records.
    checkpoint = run_dir / "checkpoints" / "step_000003"
    evaluated = run_rl("eval", str(checkpoint), "--data", str(rows), "--engine", "torch",
                    "--max-new-tokens", "96")  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    assert "greedy accuracy" in evaluated.stdout and "over 3 prompts" in evaluated.stdout

    # Carried over: episodes stop every 16 tokens, mid-turn, and continue in a later epoch
    # under a newer version; the steps take the episodes that finish first.
    carried = run_rl(
        "train", RECIPE, *overrides, "run.name=agent-carry", "run.num_steps=2",
        "run.eval_every=0", "scheduler.partial_rollout=carry", "scheduler.abort_every=16",
    )  # fmt: skip
    assert carried.returncode == 0, carried.stderr[-4000:]
    carry_dir = tmp_path / "runs" / "agent-carry"
    lines = (carry_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines][1:]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["agent/tool_calls_mean"] > 0.5 and record["agent/turns_mean"] > 1.5
        assert record["carry/max_token_age"] <= 4
    # Episodes that finished an epoch after they began: stopped mid-turn and continued.
    assert max(r["carry/carried_groups"] for r in steps) > 0
