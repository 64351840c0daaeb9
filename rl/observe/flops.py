"""Training FLOPs from the model's config, and device peaks: model FLOPs utilisation (MFU).

MFU counts the FLOPs the model needs, not those the run spends, by PaLM's definition
(Chowdhery et al. 2022, Appendix B): 6 N + 12 L H Q T per trained token at sequence length T.
6 N is the matmuls of forward and backward (N parameters, embeddings included); 12 L H Q T is
attention's two products over the sequence, the scores Q K^T and their weighted sum of V: each
Q T multiply-adds (2 Q T FLOPs) per token, head and layer forward, twice that in backward (L
layers, H heads of Q dimensions). A forward alone (generation, log-probs) is a third of that:
2 N + 4 L H Q T. For a mixture of experts N is the parameters a token uses (its top-k experts,
the router, any shared expert, attention and embeddings: `ModelShape.num_active_params`), not
all the experts it holds. The half that the causal mask skips is counted too, as PaLM counts
it, so that the MFU compares with other systems' reports. Recomputation (activation
checkpointing) and the log-prob pass before training are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl.cluster.memory_plan import ModelShape

# Dense bf16 peak TFLOP/s (no sparsity) of common training GPUs, by a part of their name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def forward_flops_per_token(shape: ModelShape, seq_len: float) -> float:
    """Model FLOPs of one token's forward in sequences of `seq_len` tokens."""
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len
    return 2 * shape.num_active_params + attention


def train_flops_per_token(shape: ModelShape, seq_len: float) -> float:
    """Model FLOPs of one trained token in sequences of `seq_len` tokens: its forward and a
    backward of twice the forward's work."""
    return 3 * forward_flops_per_token(shape, seq_len)


def train_flops(shape: ModelShape, lengths: Sequence[float]) -> float:
    """Model FLOPs of training once on sequences of `lengths` tokens. A token's attention
    spans its own sequence, so a batch of mixed lengths needs more than its mean length says."""
    return sum(length * train_flops_per_token(shape, length) for length in lengths)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU named `device_name`; None if not known (CPUs)."""
    return next((tf * 1e12 for part, tf in PEAK_TFLOPS.items() if part in device_name), None)
