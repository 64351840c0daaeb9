"""Model FLOPs per trained token and device peaks, for MFU."""

from __future__ import annotations

import json
from pathlib import Path

from rl.cluster.memory_plan import ModelShape
from rl.observe.flops import peak_flops, train_flops_per_token


def test_training_flops_are_six_per_parameter_plus_causal_attention(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.read(tmp_path)
    # 24 layers x 14 heads x 64 dims, half of a 1024-token sequence on average.
    assert train_flops_per_token(shape, 1024) == 6 * 494_032_768 + 6 * 24 * 14 * 64 * 512


def test_known_gpus_have_a_peak_and_cpus_none() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
