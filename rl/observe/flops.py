"""Training FLOPs from the model's config, and device peaks: model FLOPs utilisation (MFU).

MFU counts the FLOPs the model needs, not those the run spends: 6 N per trained token for the
matmuls of forward and backward (N parameters, embeddings included) plus causal attention's
score and value products, 6 L H d T / 2 per token at sequence length T. Recomputation
(activation checkpointing) and the log-prob pass before training are not counted, as in
PaLM's definition.
"""

from __future__ import annotations

from rl.cluster.memory_plan import ModelShape

# Dense bf16 peak TFLOP/s (no sparsity) of common training GPUs, by a part of their name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def train_flops_per_token(shape: ModelShape, seq_len: float) -> float:
    """Model FLOPs of one trained token in sequences of `seq_len` tokens."""
    attention = 6 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len / 2
    return 6 * shape.num_params + attention


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU named `device_name`; None if not known (CPUs)."""
    return next((tf * 1e12 for part, tf in PEAK_TFLOPS.items() if part in device_name), None)
