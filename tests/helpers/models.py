"""Tiny randomly initialised HF checkpoints built locally (no hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from rl.config import BaseBuildConfig
from trainer.hf_model import new_model, save_hf_atomic, train_tokenizer


def _arithmetic_corpus(num_lines: int = 2000) -> list[str]:
    rng = random.Random(0)
    return [
        f"{rng.randint(0, 999)}+{rng.randint(0, 999)}={rng.randint(0, 1998)}"
        for _ in range(num_lines)
    ]


def build_tiny_checkpoint(path: Path, tie_word_embeddings: bool, seed: int = 0) -> Path:
    """A 2-layer Qwen2 (head_dim 32, as vLLM's CPU attention needs) with a trained BPE tokenizer."""
    cfg = BaseBuildConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        tie_word_embeddings=tie_word_embeddings,
    )
    tokenizer = train_tokenizer(_arithmetic_corpus(), cfg.vocab_size)
    model = new_model(cfg, tokenizer, seed=seed)
    return save_hf_atomic(model, tokenizer, path)


def build_checkpoint(path: Path, arch: str, tie_word_embeddings: bool, **sizes: int) -> Path:
    """A random Qwen2 or Llama of any size (keyword `sizes` override the HF config's: e.g.
    hidden_size, num_hidden_layers, vocab_size) with the tiny tokenizer."""
    tokenizer = train_tokenizer(_arithmetic_corpus(), 64)
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_class(
        **{
            "vocab_size": -(-len(tokenizer) // 64) * 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            **sizes,
        },
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_hf_atomic(model, tokenizer, path)


# arch -> (HF config class, its mixture-of-experts keys) for `build_moe_checkpoint`.
MOE_ARCHITECTURES = {
    "qwen3_moe": (Qwen3MoeConfig, {"moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen2_moe": (
        Qwen2MoeConfig,
        {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    ),
    "mixtral": (MixtralConfig, {}),  # its experts are intermediate_size wide
}


def build_moe_checkpoint(path: Path, arch: str, tie_word_embeddings: bool = False) -> Path:
    """A random 2-layer mixture of experts (8 experts, top-2, head_dim 32; qwen2_moe with a
    gated shared expert) with the tiny tokenizer, saved as `save_pretrained` writes it: one
    tensor per expert and projection."""
    tokenizer = train_tokenizer(_arithmetic_corpus(), 64)
    config_class, experts = MOE_ARCHITECTURES[arch]
    num_experts = {"num_local_experts" if arch == "mixtral" else "num_experts": 8}
    config = config_class(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts_per_tok=2,
        **num_experts,
        **experts,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_hf_atomic(model, tokenizer, path)


def remove_pad_token(model_dir: Path) -> None:
    """Make `model_dir` look like a Llama-3 or Mistral checkpoint: no pad token anywhere."""
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        data.pop("pad_token", None)
        data.pop("pad_token_id", None)
        path.write_text(json.dumps(data, indent=2))
