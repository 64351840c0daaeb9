"""Model FLOPs per trained token and device peaks, for MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.cluster.memory_plan import ModelShape
from rl.observe.flops import peak_flops, train_flops, train_flops_per_token

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


def test_known_gpus_have_a_peak_and_cpus_none() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
