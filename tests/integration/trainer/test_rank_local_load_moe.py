"""Rank-local loading of mixtures of experts on real gloo groups of 1 and 2 ranks: each rank
reads its own experts (dim-0 rows of the fused `mlp.experts.gate_up_proj` / `down_proj`) from
the checkpoint's per-expert tensors, and the sharded trainer model holds, bit for bit, what
`from_pretrained` loads: Qwen3-MoE, Qwen2-MoE (shared expert and its gate), Mixtral (renamed
`block_sparse_moe`, w1/w3/w2), and a checkpoint that stores the fused tensors themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rl.config import Config
from rl.config.safetensors_files import checkpoint_tensors
from tests.helpers.models import build_moe_checkpoint
from tests.helpers.ports import free_port
from trainer.fsdp import (
    decoder_layers,
    load_sharded,
    shard_with_fsdp,
    sharding_mesh,
    with_lora,
)
from trainer.rank_local_load import load_local_rows, meta_causal_lm, restore_computed_buffers
from trainer.ranks import init_rank

pytestmark = pytest.mark.integration

CHECKPOINTS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_moe_fused")
# LoRA's default targets: on a mixture of experts peft adapts the attention's linears and (its
# own mapping of gate/up/down_proj) the fused expert parameters, each inside a wrapper.
LORA = {"rank": 4}
SEED = 5


def _config(model_dir: Path, world_size: int, model: dict | None = None) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir), **(model or {})},
            "trainer": {"num_workers": world_size},
        }
    )


def _rank_main(rank: int, world_size: int, dirs: dict[str, Path], port: int, out: Path) -> None:
    """Per checkpoint, the full parameters and buffers of the trainer's policy as loaded on
    this group; and one loaded reading 1000 bytes at a time (a few rows of an expert)."""
    results: dict = {}
    init_rank(rank, world_size, "127.0.0.1", port, _config(dirs["qwen3_moe"], world_size).trainer)
    for label in CHECKPOINTS:
        cfg = _config(dirs[label], world_size)
        mesh = sharding_mesh("cpu", world_size, cfg.trainer)
        loaded = load_sharded(cfg.model, cfg.trainer, mesh, trainable=True)
        results[label] = {
            "params": {n: p.detach().full_tensor() for n, p in loaded.model.named_parameters()},
            "buffers": dict(loaded.model.named_buffers()),
        }
    cfg = _config(dirs["qwen3_moe"], world_size, {"lora": LORA})
    mesh = sharding_mesh("cpu", world_size, cfg.trainer)
    loaded = load_sharded(cfg.model, cfg.trainer, mesh, trainable=True, seed=SEED)
    results["qwen3_moe_lora"] = {
        "params": {n: p.detach().full_tensor() for n, p in loaded.model.named_parameters()},
        "buffers": dict(loaded.model.named_buffers()),
    }
    cfg = _config(dirs["qwen2_moe"], world_size)
    model = meta_causal_lm(str(dirs["qwen2_moe"]))
    mesh = sharding_mesh("cpu", world_size, cfg.trainer)
    shard_with_fsdp(model, decoder_layers(model, "moe"), mesh, "float32", cfg.trainer)
    model.to_empty(device="cpu")
    load_local_rows(model, str(dirs["qwen2_moe"]), read_bytes=1000)
    restore_computed_buffers(model)
    results["qwen2_moe_in_chunks"] = {
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
    }
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out / "rank0.pt")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_checkpoints")
    dirs = {arch: build_moe_checkpoint(root / arch, arch) for arch in CHECKPOINTS[:3]}
    # The fused layout on disk: the model's own state dict, as `from_pretrained` also loads it.
    fused = root / "qwen3_moe_fused"
    shutil.copytree(dirs["qwen3_moe"], fused)
    model = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32)
    (fused / "model.safetensors").unlink()
    save_file(model.state_dict(), fused / "model.safetensors", metadata={"format": "pt"})
    return dirs | {"qwen3_moe_fused": fused}


@pytest.fixture(scope="module", params=[1, 2], ids=["ws1", "ws2"])
def loaded(request: pytest.FixtureRequest, dirs: dict[str, Path], tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"rank_local_moe_ws{request.param}")
    mp.spawn(_rank_main, args=(request.param, dirs, free_port(), out), nprocs=request.param)
    return torch.load(out / "rank0.pt")


def test_the_checkpoints_store_experts_as_save_pretrained_writes_them(
    dirs: dict[str, Path],
) -> None:
    """What the loader reads: one tensor per expert (Mixtral's under its own names), or the
    fused tensors alone."""
    for label, expert in (
        ("qwen3_moe", "model.layers.1.mlp.experts.7.up_proj.weight"),
        ("qwen2_moe", "model.layers.1.mlp.experts.7.up_proj.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.7.w3.weight"),
    ):
        names = checkpoint_tensors(dirs[label])
        assert expert in names and not any("gate_up_proj" in n for n in names), label
    fused = checkpoint_tensors(dirs["qwen3_moe_fused"])
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert not any(".experts.0." in n for n in fused)


@pytest.mark.parametrize("label", [*CHECKPOINTS, "qwen2_moe_in_chunks", "qwen3_moe_lora"])
def test_each_ranks_experts_make_up_the_model_from_pretrained_loads_bit_for_bit(
    loaded: dict, dirs: dict[str, Path], label: str
) -> None:
    checkpoint = label.removesuffix("_in_chunks").removesuffix("_lora")
    want = AutoModelForCausalLM.from_pretrained(dirs[checkpoint], dtype=torch.float32)
    if label.endswith("_lora"):
        # peft's own adapters, drawn from the same seed on one process.
        want = with_lora(want, _config(dirs[checkpoint], 1, {"lora": LORA}).model.lora, SEED)
        assert "model.layers.0.mlp.experts.lora_A.default.weight" in "".join(
            n for n, _ in want.named_parameters()
        )
    params, buffers = loaded[label]["params"], loaded[label]["buffers"]
    assert params.keys() == dict(want.named_parameters()).keys()
    assert any(name.endswith("gate_up_proj") and "experts" in name for name in params)
    for name, param in want.named_parameters():
        assert torch.equal(params[name], param), name
    assert buffers.keys() == dict(want.named_buffers()).keys() and buffers
    for name, buffer in want.named_buffers():
        assert torch.equal(buffers[name], buffer), name
