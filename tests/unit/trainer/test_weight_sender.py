"""What a trainer rank sends: trainable tensors in HF names, tied ones once, whole layers."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Qwen2Config

from trainer.weight_sender import attention_shape, trained_tensors


def _model(tie: bool):
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    return AutoModelForCausalLM.from_config(config)


def test_tied_embedding_is_sent_once_and_frozen_tensors_not_at_all() -> None:
    model = _model(tie=True)
    names = [spec.name for spec in trained_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model.model.layers[0].mlp.requires_grad_(False)  # gate, up and down: whole layers
    names = [spec.name for spec in trained_tensors(model)]
    assert not any(".mlp." in name for name in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_freezing_part_of_a_fused_layer_is_a_clear_error() -> None:
    model = _model(tie=False)
    model.model.layers[0].self_attn.q_proj.requires_grad_(False)
    with pytest.raises(ValueError, match=r"freezes .*q_proj.*self_attn.qkv_proj.*freeze all of"):
        trained_tensors(model)


def test_attention_shape_reads_the_hf_config() -> None:
    shape = attention_shape(_model(tie=False).config)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (
        2,
        1,
        32,
        128,
    )
