"""Fused log-prob/entropy kernels that never materialise the full [N, V] logits."""

from kernels.logprobs import fused_logprobs

__all__ = ["fused_logprobs"]
