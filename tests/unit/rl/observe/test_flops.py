"""Model FLOPs per trained token and device peaks, for MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.cluster.memory_plan import ModelShape
from rl.observe.flops import (
    forward_flops_per_token,
    peak_flops,
    train_flops,
    train_flops_per_token,
)

# Qwen2.5-0.5B: L = 24 layers, H = 14 heads of Q = 896 / 14 = 64 dimensions.
QWEN25_05B = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "tie_word_embeddings": True,
}  # fmt: skip
# Its N, embeddings tied: the embedding, then per layer q with its bias, k and v (2 KV heads of
# 64) with theirs, o, the gated MLP and two norms; and the final norm.
LAYER = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
N = 151936 * 896 + 24 * LAYER + 896


@pytest.fixture
def shape(tmp_path: Path) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    return ModelShape.read(tmp_path)


def test_training_flops_per_token_are_palms_6n_plus_12lhqt(shape: ModelShape) -> None:
    assert N == 494_032_768  # the count Qwen publishes as 0.49B
    # PaLM (Chowdhery et al. 2022, Appendix B): 6N + 12 L H Q T, here at T = 1024 tokens.
    assert train_flops_per_token(shape, 1024) == 6 * N + 12 * 24 * 14 * 64 * 1024


def test_a_batch_counts_each_tokens_attention_over_its_own_sequence(shape: ModelShape) -> None:
    # 1024 tokens of a 1024-token sequence and 512 of a 512-token one.
    expected = 1024 * (6 * N + 12 * 24 * 14 * 64 * 1024) + 512 * (6 * N + 12 * 24 * 14 * 64 * 512)
    assert train_flops(shape, [1024, 512]) == expected


def test_a_mixture_of_experts_counts_the_parameters_a_token_uses(tmp_path: Path) -> None:
    # Qwen3-30B-A3B's config.json: 48 layers, 32 heads of 128, 128 experts of which 8 a token.
    config = {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.read(tmp_path)
    # A token's parameters: per layer q and o (2048 x 4096), k and v (2048 x 512), the q and k
    # norms (128), two norms, the router (128 x 2048) and 8 experts of three 2048 x 768
    # matrices; the embedding, the untied head and the final norm.
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048 + 128 * 2048
    active = 48 * (layer + 8 * 3 * 2048 * 768) + 2 * 151936 * 2048 + 2048
    assert train_flops_per_token(shape, 1024) == 6 * active + 12 * 48 * 32 * 128 * 1024
    # A forward alone (generation, log-probs): 2 FLOPs a parameter, attention's forward.
    assert forward_flops_per_token(shape, 1024) == 2 * active + 4 * 48 * 32 * 128 * 1024


def test_a_forward_of_a_dense_model_is_2n_plus_4lhqt(shape: ModelShape) -> None:
    assert forward_flops_per_token(shape, 1024) == 2 * N + 4 * 24 * 14 * 64 * 1024


def test_known_gpus_have_a_peak_and_cpus_none() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
