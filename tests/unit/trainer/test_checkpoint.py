"""A trainer checkpoint in one process: it loads back exactly, and metadata an attacker
rewrote (a weight re-declared as a pickle, a shard outside the directory) is refused before
anything of it is unpickled or read."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.helpers.tampering import redeclare_as_pickle, relocate_shards
from trainer.checkpoint import load_training_state, save_training_state
from trainer.ranks import adamw_with_warmup

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")

WEIGHT = "model.0.weight"  # DCP's key of the first layer's weight


def _fresh(seed: int = 1) -> tuple:
    """(model, optimizer, scheduler) as the trainer builds them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return (model, *adamw_with_warmup(model.parameters(), 1e-2, (0.9, 0.99), 0.0, 3))


def _trained() -> tuple:
    model, optimizer, scheduler = _fresh(seed=0)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _saved(directory: Path) -> Path:
    save_training_state(directory, 0, *_trained())
    return directory


def _metadata_file(directory: Path) -> str:
    return re.escape(str(directory / ".metadata"))


def test_a_checkpoint_loads_back_exactly_and_holds_only_tensors(tmp_path: Path) -> None:
    directory = _saved(tmp_path / "ckpt")
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # the test's own file
    # What refusing bytes items relies on: the model and the optimizer state (its step
    # included) are all tensors; the schedule and RNG states are JSON files.
    assert all(isinstance(m, TensorStorageMetadata) for m in metadata.state_dict_metadata.values())
    assert any(key.endswith(".step") for key in metadata.state_dict_metadata)

    model, optimizer, scheduler = _trained()
    loaded = _fresh()
    load_training_state(directory, 0, *loaded)
    restored = loaded[0].state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored[name], tensor), name
    for want, got in zip(optimizer.state.values(), loaded[1].state.values(), strict=True):
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert loaded[2].state_dict() == scheduler.state_dict()


def test_a_weight_redeclared_as_a_pickle_is_refused_before_it_is_unpickled(
    tmp_path: Path,
) -> None:
    directory = _saved(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    redeclare_as_pickle(directory, WEIGHT, marker)
    with pytest.raises(
        ValueError, match=rf"{_metadata_file(directory)} declares {WEIGHT} as BytesStorage"
    ):
        load_training_state(directory, 0, *_fresh())
    assert not marker.exists()


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_shard_outside_the_checkpoint_is_refused(tmp_path: Path, how: str) -> None:
    directory = _saved(tmp_path / "ckpt")
    # Real shards, which a reader that follows the path loads without complaint.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for shard in directory.glob("*.distcp"):
        shutil.copy(shard, outside)
    if how == "symlink":
        os.symlink(outside, directory / "link")
    prefix = {"dotdot": "../elsewhere/", "absolute": f"{outside}/", "symlink": "link/"}[how]
    relocate_shards(directory, WEIGHT, prefix)
    with pytest.raises(
        ValueError, match=rf"{_metadata_file(directory)} places {WEIGHT} in .* outside"
    ):
        load_training_state(directory, 0, *_fresh())
