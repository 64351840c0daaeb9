"""Choosing the checkpoint to resume from, and refusing ones of another run or model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rl.checkpoint import base_weights
from rl.checkpoint.resume import find_resume_point
from rl.checkpoint.store import (
    CheckpointError,
    CheckpointWriter,
    checkpoint_root,
    list_checkpoints,
    newest_valid,
    verify,
)
from rl.config import Config
from rl.run.directory import RunInUse, RunLock, fresh_run_config


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


def _checkpoint(cfg: Config, step: int, shapes: dict | None = None, base: bool = False) -> Path:
    """A checkpoint as the driver writes one (`base`: with the record of model.path's
    weights, which older checkpoints lack)."""
    root = checkpoint_root(Path(cfg.run.output_dir) / cfg.run.name)
    writer = CheckpointWriter(root, keep_last=5)
    tmp = writer.begin(step)
    (tmp / "policy").mkdir()
    shapes = shapes or {"w": [4, 2], "b": [4]}
    (tmp / "policy" / "shapes.json").write_text(json.dumps(shapes))
    state = {"step": step, "config": cfg.model_dump(mode="json")}
    (tmp / "driver.json").write_text(json.dumps(state))
    if base:
        base_weights.record(base_weights.weight_hashes(Path(cfg.model.path)), tmp)
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


def test_a_fresh_start_leaves_an_earlier_runs_checkpoints_where_they_are(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    path = _checkpoint(cfg, 3)
    fresh = fresh_run_config(cfg, resuming=False)
    assert fresh.run.directory() != cfg.run.directory()  # a directory of its own
    assert find_resume_point(fresh, None) is None
    assert (path / "driver.json").exists()
    assert find_resume_point(cfg, "auto") == path  # the earlier run still continues


def _steps(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_resuming_an_older_step_sets_the_newer_ones_aside_for_every_later_search(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without this, a fault restart or `--resume auto` after `--resume step_4` would pick
    step 8 of the abandoned timeline again."""
    cfg = _cfg(tmp_path)
    paths = [_checkpoint(cfg, step) for step in (2, 4, 6, 8)]
    root = paths[0].parent
    assert find_resume_point(cfg, str(paths[1])) == paths[1]
    assert newest_valid(root) == (paths[1], [])  # the driver's fault restart
    assert _steps(list_checkpoints(root)) == ["step_000002", "step_000004"]
    (aside,) = root.glob("abandoned-*")
    assert f"step_000006, step_000008 of {root} moved to {aside}" in capsys.readouterr().out
    assert find_resume_point(cfg, "auto") == paths[1]
    # The resumed run writes its own steps 6 and 8 and prunes to keep_last: the set-aside ones
    # are neither picked nor pruned.
    writer = CheckpointWriter(root, keep_last=2)
    for step in (6, 8, 10):
        writer.commit(writer.begin(step), step)
    assert _steps(list_checkpoints(root)) == ["step_000008", "step_000010"]
    assert newest_valid(root)[0] == root / "step_000010"
    assert _steps(sorted(aside.iterdir())) == ["step_000006", "step_000008"]
    for old in aside.iterdir():
        assert verify(old)["step"] in (6, 8)


def test_auto_sets_aside_the_damaged_checkpoints_it_skipped(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    good, bad = _checkpoint(cfg, 2), _checkpoint(cfg, 4)
    (bad / "driver.json").write_text("{}")
    assert find_resume_point(cfg, "auto") == good
    assert list_checkpoints(good.parent) == [good]
    (aside,) = good.parent.glob("abandoned-*")
    assert (aside / bad.name / "driver.json").read_text() == "{}"


def test_resuming_a_set_aside_checkpoint_makes_its_timeline_the_runs_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = _cfg(tmp_path)
    paths = [_checkpoint(cfg, step) for step in (2, 4, 6)]
    root = paths[0].parent
    find_resume_point(cfg, str(paths[0]))
    (first_aside,) = root.glob("abandoned-*")
    _checkpoint(cfg, 4)  # the resumed timeline's own step 4
    back = find_resume_point(cfg, str(first_aside / "step_000006"))
    assert back == root / "step_000006"
    # Everything of the timeline left goes aside (which of it the two timelines share is not
    # known), and the resume point alone is in view: a fault restart continues from it.
    assert newest_valid(root) == (back, [])
    assert list_checkpoints(root) == [back]
    assert verify(back)["step"] == 6
    (second_aside,) = set(root.glob("abandoned-*")) - {first_aside}
    assert _steps(sorted(second_aside.iterdir())) == ["step_000002", "step_000004"]
    assert (first_aside / "step_000006" / "driver.json").is_file()  # still there, linked
    assert f"brought into {back}" in capsys.readouterr().out


def test_a_refused_resume_moves_nothing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    paths = [_checkpoint(cfg, step) for step in (2, 4)]
    changed = cfg.model_copy(deep=True)
    changed.trainer.lr = 1.0
    with pytest.raises(CheckpointError, match="trainer.lr"):
        find_resume_point(changed, str(paths[0]))
    assert list_checkpoints(paths[0].parent) == paths
    # A live run writing the directory keeps its checkpoints where it writes them.
    with RunLock(cfg.run.directory()), pytest.raises(RunInUse):
        find_resume_point(cfg, str(paths[0]))
    assert list_checkpoints(paths[0].parent) == paths


def _change_one_weight(cfg: Config) -> None:
    weights = torch.zeros(4, 2)
    weights[1, 1] = 1e-3
    save_file({"w": weights, "b": torch.zeros(4)}, Path(cfg.model.path) / "model.safetensors")


def test_a_base_whose_weights_changed_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The frozen reference and frozen parameters are reloaded from model.path: a base with
    the same shapes but another value would make the resumed run diverge silently."""
    cfg = _cfg(tmp_path)
    old, newer = _checkpoint(cfg, 2, base=True), _checkpoint(cfg, 4, base=True)
    assert find_resume_point(cfg, "auto") == newer  # the unchanged base is accepted
    _change_one_weight(cfg)
    with pytest.raises(CheckpointError) as refused:
        find_resume_point(cfg, str(old))
    message = str(refused.value)
    assert f"model.path={cfg.model.path} is not the base checkpoint {old} was trained from" in (
        message
    )
    assert "model.safetensors has sha256" in message
    assert list_checkpoints(old.parent) == [old, newer]  # refused before anything moved
    with pytest.raises(CheckpointError, match="model.safetensors has sha256"):
        find_resume_point(cfg, "auto")
    (Path(cfg.model.path) / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        find_resume_point(cfg, "auto")


def test_a_checkpoint_without_the_base_record_is_resumed_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = _cfg(tmp_path)
    path = _checkpoint(cfg, 2)
    assert find_resume_point(cfg, str(path)) == path
    assert f"warning: {path} has no base_weights.json" in capsys.readouterr().err


def test_a_lora_checkpoint_holds_adapters_only_and_each_must_fit_its_base_linear(
    tmp_path: Path,
) -> None:
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "model").mkdir()
    # The base's proj is [out 4, in 2]: its A is [r, in], its B [out, r]; no base tensor is kept.
    save_file({"proj.weight": torch.zeros(4, 2)}, tmp_path / "lora" / "model" / "model.safetensors")
    cfg = _cfg(tmp_path / "lora")
    cfg.model.lora.rank = 8
    fits = {
        "base_model.model.proj.lora_A.default.weight": [8, 2],
        "base_model.model.proj.lora_B.default.weight": [4, 8],
    }
    path = _checkpoint(cfg, 3, shapes=fits)
    assert find_resume_point(cfg, str(path)) == path
    wrong_in = {**fits, "base_model.model.proj.lora_A.default.weight": [8, 3]}
    other = _checkpoint(cfg, 5, shapes=wrong_in)
    with pytest.raises(
        CheckpointError, match=r"lora_A.default.weight has shape \[8, 3\] .* proj.weight \[4, 2\]"
    ):
        find_resume_point(cfg, str(other))
    # A full fine-tune's checkpoint must hold every base tensor.
    full = _cfg(tmp_path)
    partial = _checkpoint(full, 7, shapes={"w": [4, 2]})
    with pytest.raises(CheckpointError, match="the checkpoint lacks b of model.path"):
        find_resume_point(full, str(partial))
