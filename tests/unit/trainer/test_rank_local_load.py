"""Rank-local loading of a mixture of experts whose checkpoint cannot make its fused expert
tensors row by row: refused, naming the model directory and the tensor (one process, no
process group: every tensor is this rank's whole)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    Transpose,
    WeightConverter,
)

import trainer.rank_local_load as rank_local_load
from tests.helpers.models import build_moe_checkpoint
from trainer.rank_local_load import load_local_rows, meta_causal_lm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def _load(model_dir: Path) -> None:
    model = meta_causal_lm(str(model_dir))
    model.to_empty(device="cpu")
    load_local_rows(model, str(model_dir))


def test_a_conversion_that_is_not_a_stack_of_whole_experts_is_refused_naming_the_tensor(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapping that also transposes each stacked tensor: a row of the result is no longer
    one expert's own tensors, so no rank can read its rows alone."""
    transposed = [
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1), Transpose(0, 1)],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]
    monkeypatch.setattr(
        rank_local_load, "get_checkpoint_conversion_mapping", lambda model_type: transposed
    )
    with pytest.raises(ValueError) as error:
        _load(moe_dir)
    message = str(error.value)
    assert f"model directory {moe_dir}" in message
    assert "'model.layers.0.mlp.experts.gate_up_proj' cannot be read rank by rank" in message


def test_an_expert_missing_one_projection_is_refused_naming_the_tensor(
    moe_dir: Path, tmp_path: Path
) -> None:
    cut = tmp_path / "cut"
    cut.mkdir()
    for file in moe_dir.iterdir():
        if file.name != "model.safetensors":
            (cut / file.name).write_bytes(file.read_bytes())
    tensors = load_file(moe_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        _load(cut)
    message = str(error.value)
    assert f"model directory {cut}" in message
    assert "'model.layers.1.mlp.experts.gate_up_proj' cannot be read rank by rank" in message
    assert "do not pair up" in message


def test_experts_stored_short_of_the_config_are_refused_with_both_shapes(
    moe_dir: Path, tmp_path: Path
) -> None:
    """The last expert gone whole (all three projections): seven rows where the config makes
    eight."""
    cut = tmp_path / "cut"
    cut.mkdir()
    for file in moe_dir.iterdir():
        if file.name != "model.safetensors":
            (cut / file.name).write_bytes(file.read_bytes())
    tensors = {
        name: tensor
        for name, tensor in load_file(moe_dir / "model.safetensors").items()
        if ".experts.7." not in name
    }
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        _load(cut)
    assert str(error.value) == (
        f"model directory {cut}: tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape "
        "[7, 64, 64], but its config.json makes it [8, 64, 64]"
    )
