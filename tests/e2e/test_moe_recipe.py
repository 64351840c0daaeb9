"""The mixture-of-experts recipe with routing replay, at tiny size: `rl train` builds a Qwen3-MoE
base, the torch engine records the experts of every position it runs, and the trainer's
forwards replay them; a trainer pass recomputes the proximal log-probs, so the step reports
how far the trainer's log-probs are from the engine's on the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.helpers.cli import run_rl
from tests.helpers.metric_keys import check_metric_keys

pytestmark = pytest.mark.e2e


def test_moe_recipe_replays_the_engines_routing_and_matches_its_logprobs(tmp_path: Path) -> None:
    base = tmp_path / "base"
    overrides = [
        f"model.path={base}",
        f"data.dir={tmp_path / 'data'}",
        f"run.output_dir={tmp_path / 'runs'}",
        "base.sft_steps=30",
        "run.num_steps=2",
        "run.prompts_per_step=16",
        "run.num_eval_prompts=0",
        "run.wandb_mode=disabled",
        "run.tensorboard=false",
        # Samples of the trained version only, scored again by the trainer: the gap is the
        # engine's and the trainer's arithmetic, not the policy's change.
        "scheduler.max_staleness=0",
        "algorithm.recompute_old_logprobs=true",
        "algorithm.router_balance_coef=0.01",
    ]
    result = run_rl("train", "recipes/grpo_addition_moe_cpu.yaml", *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    config = AutoConfig.from_pretrained(base)
    assert config.model_type == "qwen3_moe" and config.num_experts == 8

    run_dir = tmp_path / "runs" / "grpo-addition-moe"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    check_metric_keys(records)
    for record in records[1:]:
        # The records reached the trainer (the key is there only when a position was
        # replayed) and its routers agree with the engine's: a record off by one position
        # would disagree on most pairs.
        assert record["moe/replay_disagreement"] < 0.01
        # fp32: the trainer's log-probs of the sampled tokens are the engine's (issue 48).
        assert record["off_policy/max_abs_logprob_gap"] <= 1e-4
        assert (
            0
            < record["off_policy/mean_abs_logprob_gap"]
            <= record["off_policy/max_abs_logprob_gap"]
        )
        # Two layers of 8 experts: every (token, slot) assignment is counted once per layer.
        for layer in (0, 1):
            shares = [record[f"moe/layer{layer}/expert{e}_share"] for e in range(8)]
            assert math.isclose(sum(shares), 1.0, rel_tol=1e-9)
