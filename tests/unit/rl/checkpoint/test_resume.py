"""Choosing the checkpoint to resume from, and refusing ones of another run or model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rl.checkpoint.resume import find_resume_point
from rl.checkpoint.store import CheckpointError, CheckpointWriter, checkpoint_root
from rl.config import Config


def _cfg(tmp_path: Path, **run: object) -> Config:
    model = tmp_path / "model"
    if not model.exists():
        model.mkdir()
        save_file({"w": torch.zeros(4, 2), "b": torch.zeros(4)}, model / "model.safetensors")
    return Config.model_validate(
        {
            "model": {"path": str(model)},
            "run": {"output_dir": str(tmp_path / "runs"), "num_steps": 10, **run},
        }
    )


def _checkpoint(cfg: Config, step: int, shapes: dict | None = None) -> Path:
    root = checkpoint_root(Path(cfg.run.output_dir) / cfg.run.name)
    writer = CheckpointWriter(root, keep_last=5)
    tmp = writer.begin(step)
    (tmp / "policy").mkdir()
    shapes = shapes or {"w": [4, 2], "b": [4]}
    (tmp / "policy" / "shapes.json").write_text(json.dumps(shapes))
    state = {"step": step, "config": cfg.model_dump(mode="json")}
    (tmp / "driver.json").write_text(json.dumps(state))
    return writer.commit(tmp, step)


def test_auto_takes_the_newest_good_checkpoint_and_skips_damaged_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = _cfg(tmp_path)
    assert find_resume_point(cfg, "auto") is None  # nothing yet: a fresh start
    good, bad = _checkpoint(cfg, 2), _checkpoint(cfg, 4)
    (bad / "driver.json").write_text("{}")
    assert find_resume_point(cfg, "auto") == good
    assert f"skipping a damaged checkpoint: checkpoint file {bad / 'driver.json'}" in (
        capsys.readouterr().err
    )


def test_an_explicit_path_must_be_a_good_checkpoint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    path = _checkpoint(cfg, 3)
    assert find_resume_point(cfg, str(path)) == path
    with pytest.raises(CheckpointError, match="does not exist"):
        find_resume_point(cfg, str(tmp_path / "nowhere"))
    (path / "policy" / "shapes.json").write_text("{}")
    with pytest.raises(CheckpointError, match="shapes.json has 2 bytes"):
        find_resume_point(cfg, str(path))


def test_a_checkpoint_of_another_config_or_model_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    path = _checkpoint(cfg, 3)
    changed = cfg.model_copy(deep=True)
    changed.trainer.lr = 1.0
    with pytest.raises(CheckpointError, match=r"trainer.lr: 1e-05 -> 1.0"):
        find_resume_point(changed, str(path))
    longer = _cfg(tmp_path, num_steps=20, eval_every=5)
    assert find_resume_point(longer, str(path)) == path  # run length may change
    shorter = _cfg(tmp_path, num_steps=2)
    with pytest.raises(CheckpointError, match="past run.num_steps=2"):
        find_resume_point(shorter, str(path))
    other_model = _checkpoint(cfg, 5, shapes={"w": [8, 2], "b": [4]})
    with pytest.raises(CheckpointError, match=r"shapes.json: w has shape \[8, 2\]"):
        find_resume_point(cfg, str(other_model))


def test_a_fresh_start_moves_earlier_checkpoints_aside(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    path = _checkpoint(cfg, 3)
    assert find_resume_point(cfg, None) is None
    assert not path.exists()
    (aside,) = path.parent.parent.glob("checkpoints.before-*")
    assert (aside / path.name / "driver.json").exists()
