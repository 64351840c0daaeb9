"""Rank-local loading on a real 2-rank gloo group: each rank reads only its rows of the
checkpoint, and the sharded model holds, bit for bit, what `from_pretrained` loads (the
policy on several meshes, tied and untied, LoRA's first adapters, the critic's backbone)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rl.config import Config
from tests.helpers.ports import free_port
from trainer.critic import load_value_model
from trainer.fsdp import decoder_layers, load_sharded, shard_with_fsdp, sharding_mesh, with_lora
from trainer.rank_local_load import load_local_rows, meta_causal_lm, restore_computed_buffers
from trainer.ranks import init_rank

pytestmark = pytest.mark.integration

LORA = {"rank": 4, "target_modules": ["q_proj", "down_proj"]}
SEED = 5
# label -> (checkpoint, trainer.* overrides, model.* overrides)
CASES = {
    "untied_zero3": ("untied", {}, {}),
    "tied_hybrid_2x1": ("tied", {"sharding": "hybrid", "shard_group_size": 1}, {}),
    "tied_none": ("tied", {"sharding": "none"}, {}),
    "untied_lora": ("untied", {}, {"lora": LORA}),
    # Loaded piece by piece, reading 1000 bytes at a time (`load_local_rows`' read_bytes).
    "untied_zero3_in_chunks": ("untied", {}, {}),
}


def _config(model_dir: Path, trainer: dict, model: dict) -> Config:
    return Config.model_validate(
        {"model": {"path": str(model_dir), **model}, "trainer": {"num_workers": 2, **trainer}}
    )


def _rank_main(rank: int, dirs: dict[str, Path], port: int, out: Path) -> None:
    """Per case, the full parameters and buffers of the loaded policy; the critic's; and the
    error a checkpoint with a wrong-shaped tensor gives."""
    results: dict = {}
    init_rank(rank, 2, "127.0.0.1", port, _config(dirs["untied"], {}, {}).trainer)
    for label, (checkpoint, trainer, model) in CASES.items():
        if label.endswith("_in_chunks"):
            continue
        cfg = _config(dirs[checkpoint], trainer, model)
        mesh = sharding_mesh("cpu", 2, cfg.trainer)
        loaded = load_sharded(cfg.model, cfg.trainer, mesh, trainable=True, seed=SEED)
        results[label] = {
            "params": {n: p.detach().full_tensor() for n, p in loaded.model.named_parameters()},
            "buffers": dict(loaded.model.named_buffers()),
        }
    # Reading a few rows at a time: chunks of 3 rows of 64 fp32 values, ending unevenly.
    cfg = _config(dirs["untied"], {}, {})
    model = meta_causal_lm(str(dirs["untied"]))
    mesh = sharding_mesh("cpu", 2, cfg.trainer)
    shard_with_fsdp(model, decoder_layers(model, "tiny"), mesh, "float32", cfg.trainer)
    model.to_empty(device="cpu")
    load_local_rows(model, str(dirs["untied"]), read_bytes=1000)
    restore_computed_buffers(model)
    results["untied_zero3_in_chunks"] = {
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
    }
    cfg = _config(dirs["tied"], {}, {})
    critic = load_value_model(
        str(dirs["tied"]), "float32", sharding_mesh("cpu", 2, cfg.trainer), cfg.trainer
    )
    results["critic"] = {n: p.detach().full_tensor() for n, p in critic.named_parameters()}
    cfg = _config(dirs["cut"], {}, {})
    try:
        load_sharded(cfg.model, cfg.trainer, sharding_mesh("cpu", 2, cfg.trainer), True)
    except ValueError as exc:
        results["cut_error"] = str(exc)
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out / "rank0.pt")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tiny_tied_model_dir: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rank_local")
    # The untied checkpoint with its last layer's up_proj one row short of its config.
    cut = out / "cut"
    shutil.copytree(tiny_model_dir, cut)
    tensors = load_file(cut / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][1:]
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    dirs = {"untied": tiny_model_dir, "tied": tiny_tied_model_dir, "cut": cut}
    mp.spawn(_rank_main, args=(dirs, free_port(), out), nprocs=2)
    return torch.load(out / "rank0.pt") | {"dirs": dirs}


def _pretrained(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("label", CASES)
def test_each_ranks_rows_make_up_the_checkpoint_from_pretrained_loads_bit_for_bit(
    loaded: dict, label: str
) -> None:
    checkpoint, _, model = CASES[label]
    want = _pretrained(loaded["dirs"][checkpoint])
    if "lora" in model:
        # peft's own adapters, drawn from the same seed on one process.
        cfg = _config(loaded["dirs"][checkpoint], {}, model)
        want = with_lora(want, cfg.model.lora, SEED)
        assert any("lora_A" in n for n, _ in want.named_parameters())
    params, buffers = loaded[label]["params"], loaded[label]["buffers"]
    assert params.keys() == dict(want.named_parameters()).keys()
    for name, param in want.named_parameters():
        assert torch.equal(params[name], param), name
    # The rotary frequencies, which no file holds.
    assert buffers.keys() == dict(want.named_buffers()).keys() and buffers
    for name, buffer in want.named_buffers():
        assert torch.equal(buffers[name], buffer), name


def test_the_critic_loads_the_decoder_bit_for_bit_under_a_zero_head(loaded: dict) -> None:
    decoder = _pretrained(loaded["dirs"]["tied"]).get_decoder()
    critic = loaded["critic"]
    for name, param in decoder.named_parameters():
        assert torch.equal(critic[f"backbone.{name}"], param), name
    assert not critic["head.weight"].any() and not critic["head.bias"].any()


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it_and_both_shapes(loaded: dict) -> None:
    error = loaded["cut_error"]
    assert "'model.layers.1.mlp.up_proj.weight' has shape [127, 64]" in error
    assert "config.json makes it [128, 64]" in error and str(loaded["dirs"]["cut"]) in error
