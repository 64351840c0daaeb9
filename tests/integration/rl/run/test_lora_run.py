"""A LoRA GRPO run through the whole stack (real Ray, vLLM on CPU, a 2-rank FSDP2 trainer):
only the adapters travel at each sync, the run checkpoints them alone and exports them, and a
resume from a checkpoint logs the next step's metrics bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from rl.checkpoint.resume import find_resume_point
from rl.config import Config
from rl.run.driver import train
from tests.helpers.resumed_steps import computed
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base

pytestmark = pytest.mark.integration

RANK = 8


def _records(cfg: Config) -> list[dict]:
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_syncs_adapters_only_exports_them_and_resumes_exactly(
    tmp_path: Path, tiny_base: Path
) -> None:
    tree = tiny_run_tree(
        with_tiny_base(tmp_path / "shared", tiny_base),
        tmp_path / "runs",
        "lora",
        # Dropout draws from the trainer ranks' generators: a resume must restore them. The
        # log-prob pass that recomputes the old log-probs runs first after a resume, without it.
        model={"lora": {"rank": RANK, "dropout": 0.1}},
        algorithm={"recompute_old_logprobs": True},
        run={"num_steps": 3},
        checkpoint={"every": 2},
    )
    cfg = Config.model_validate(tree)
    train(cfg)
    records = _records(cfg)
    assert [r["step"] for r in records] == [0, 1, 2, 3]

    # What a sync sends, by hand: A [r, in] and B [out, r] of every targeted linear, in fp32.
    with safe_open(Path(cfg.model.path) / "model.safetensors", framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    targets = cfg.model.lora.target_modules
    adapter = sum(
        RANK * (shape[1] + shape[0])
        for name, shape in shapes.items()
        if ".layers." in name and name.split(".")[-2] in targets and name.endswith(".weight")
    )
    full_model = sum(math.prod(shape) for shape in shapes.values())
    for record in records[1:]:
        assert record["weight_sync/mb_per_rollout_rank"] * (1 << 20) == 4 * adapter
        assert record["weight_sync/mb_full_model"] * (1 << 20) == 4 * full_model

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    assert (run_dir / "hf" / "model.safetensors").is_file()
    assert (run_dir / "hf" / "adapter" / "adapter_config.json").is_file()

    checkpoint = run_dir / "checkpoints" / "step_000002"
    # The checkpoint holds the adapters (and their optimizer state), not the frozen base.
    held = json.loads((checkpoint / "policy" / "shapes.json").read_text())
    assert len(held) == 2 * len(targets) * sum(name.endswith(".q_proj.weight") for name in shapes)
    assert all(".lora_A." in name or ".lora_B." in name for name in held)
    train(cfg, resume_from=find_resume_point(cfg, str(checkpoint)))
    resumed = _records(cfg)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert computed(resumed[3]) == computed(records[3])
