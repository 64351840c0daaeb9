"""A small Qwen2-style layer's tensors (HF names) for weight-sync tests, with its attention."""

from __future__ import annotations

from rl.sync.plan import AttentionShape, TensorSpec

SYNC_SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=1000)
SYNC_SPECS = [
    TensorSpec("model.embed_tokens.weight", (1000, 128)),
    TensorSpec("model.layers.0.self_attn.q_proj.weight", (128, 128)),
    TensorSpec("model.layers.0.self_attn.q_proj.bias", (128,)),
    TensorSpec("model.layers.0.self_attn.k_proj.weight", (64, 128)),
    TensorSpec("model.layers.0.self_attn.v_proj.weight", (64, 128)),
    TensorSpec("model.layers.0.self_attn.o_proj.weight", (128, 128)),
    TensorSpec("model.layers.0.mlp.down_proj.weight", (128, 256)),
    TensorSpec("model.norm.weight", (128,)),
]
