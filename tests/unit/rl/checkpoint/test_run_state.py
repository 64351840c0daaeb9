"""A run's checkpoints as the driver writes them carry what a resume checks the base against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rl.checkpoint.base_weights import weight_hashes
from rl.checkpoint.resume import find_resume_point
from rl.checkpoint.run_state import DriverState, RunCheckpoints
from rl.checkpoint.store import CheckpointError
from rl.config import Config


class _Ranks:
    """Stands in for PolicyRanks: its shards are the tensor shapes a resume compares."""

    def save_checkpoint(self, path: Path) -> None:
        path.mkdir()
        (path / "shapes.json").write_text(json.dumps({"w": [4, 2]}))


def test_every_checkpoint_records_the_base_its_resume_is_checked_against(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(4, 2)}, model / "model.safetensors")
    (model / "config.json").write_text("{}")
    cfg = Config.model_validate(
        {"model": {"path": str(model)}, "run": {"output_dir": str(tmp_path / "runs")}}
    )
    checkpoints = RunCheckpoints(cfg, cfg.run.directory(), _Ranks(), None, weight_hashes(model))
    path = checkpoints.save(DriverState(2, {}, 0.0, 0.0))
    assert find_resume_point(cfg, "auto") == path
    save_file({"w": torch.ones(4, 2)}, model / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors has sha256"):
        find_resume_point(cfg, "auto")
