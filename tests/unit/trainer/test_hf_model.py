"""LoRA adapters keyed for PEFT's adapter file by peft itself, as an export writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl.config import LoraConfig
from trainer.hf_model import adapter_file_tensors

LORA = LoraConfig(rank=4, target_modules=["q_proj", "down_proj"])


def _trained_adapters(model_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A peft model over `model_dir` and its adapters under its parameter names, B not zero."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LORA.peft_config())
    adapters = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_()
                adapters[name] = param.detach().clone()
    return model, adapters


def test_adapters_are_keyed_as_peft_saves_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, adapters = _trained_adapters(tiny_model_dir)
    model.save_pretrained(tmp_path)  # peft's own adapter file, from the model itself
    want = load_file(tmp_path / "adapter_model.safetensors")
    got = adapter_file_tensors(tiny_model_dir, LORA, adapters)
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_a_tensor_that_is_no_adapter_or_a_missing_adapter_is_refused_by_name(
    tiny_model_dir: Path,
) -> None:
    _, adapters = _trained_adapters(tiny_model_dir)
    foreign = "base_model.model.model.embed_tokens.weight"
    with pytest.raises(ValueError, match=f"{foreign} is not a LoRA adapter of the model of"):
        adapter_file_tensors(tiny_model_dir, LORA, adapters | {foreign: torch.zeros(1)})
    dropped = sorted(adapters)[0]
    del adapters[dropped]
    with pytest.raises(ValueError, match=f"the LoRA adapter {dropped} is missing"):
        adapter_file_tensors(tiny_model_dir, LORA, adapters)
