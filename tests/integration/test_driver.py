"""Two GRPO steps through the whole stack: real Ray, vLLM on CPU, a 2-rank FSDP2 gloo group."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from rl.config import Config
from rl.driver import train

pytestmark = pytest.mark.integration


@pytest.fixture
def two_step_config(tmp_path: Path) -> Config:
    # A random model never solves a prompt, so every advantage would be 0 and nothing would
    # train: the run builds (base.build_if_missing) a small SFT base that is right part of
    # the time on 2-digit addition, so rewards within a group differ.
    return Config.model_validate(
        {
            "model": {"path": str(tmp_path / "base")},
            "base": {
                "build_if_missing": True,
                "hidden_size": 64,
                "num_layers": 2,
                "num_heads": 2,
                "num_kv_heads": 1,
                "intermediate_size": 128,
                "sft_steps": 400,
                "sft_target_accuracy": 0.3,
            },
            "data": {
                "task": "addition",
                "num_digits": 2,
                "dir": str(tmp_path / "data"),
                "num_train": 2000,
                "num_test": 20,
            },
            "rollout": {"num_workers": 1, "kv_cache_gb": 0.25, "max_new_tokens": 6},
            "trainer": {"num_workers": 2, "lr": 1e-2, "micro_batch_size": 8},
            "algorithm": {"group_size": 8},
            "run": {
                "name": "two-steps",
                "output_dir": str(tmp_path / "runs"),
                "num_steps": 2,
                "prompts_per_step": 8,
                "eval_every": 0,
                "num_eval_prompts": 8,
                "wandb_mode": "disabled",
                "progress_bar": False,
            },
        }
    )


def test_two_grpo_steps_update_weights_and_advance_the_rollout_version(
    two_step_config: Config,
) -> None:
    try:
        final = train(two_step_config)
    finally:
        ray.shutdown()
    run_dir = Path(two_step_config.run.output_dir) / "two-steps"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert 0.0 <= records[0]["eval/accuracy"] <= 1.0
    for record in records[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "time/sync_s"):
            assert record[key] is not None and math.isfinite(record[key]), key
    assert final["rollout/version"] == 2
    assert 0.0 <= final["eval/accuracy"] <= 1.0

    assert any(0 < r["reward/mean"] < 1 for r in records[1:]), "no reward signal to learn from"
    before = load_file(Path(two_step_config.model.path) / "model.safetensors")
    after = load_file(run_dir / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert "lm_head.weight" in changed and len(changed) > len(before) // 2
