"""The attention every Tandem model runs: SDPA, except for short bf16 attention on CPU.

PyTorch's CPU flash-attention kernel is slow in half precision on short sequences: there an
explicit softmax(QK^T)V is several times faster, and from a few hundred tokens on the flash
kernel's tiling wins (bench/attention.py measures where; docs/benchmarks.md). Tiny models on CPU live at those lengths, in training and
in decoding, so `attention` computes the explicit product there and calls SDPA everywhere
else (fp32, GPUs, long keys). It is registered with transformers as `ATTENTION`, with SDPA's
boolean masks, so packed rows keep their per-sample masks either way.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "tandem"  # the `attn_implementation` to load models with
# The key length up to which the explicit product beats the flash kernel (bench/attention.py).
MAX_EXPLICIT_KEYS = 192


def uses_explicit_product(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `attention` computes softmax(QK^T)V itself for these [B, H, T, D] inputs."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    return query.device.type == "cpu" and half and key.shape[2] <= MAX_EXPLICIT_KEYS


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, Tq, D], key/value [B, Hkv, Tk, D],
    `attention_mask` SDPA's boolean [B, 1, Tq, Tk] (True: attend) or None (causal, queries
    aligned to the last keys) -> ([B, Tq, H, D], None)."""
    if not uses_explicit_product(query, key):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    return explicit_product(query, key, value, attention_mask, scale, dropout), None


def explicit_product(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(QK^T * scaling)V with the [B, H, Tq, Tk] scores in memory, as `attention` takes
    its inputs -> [B, Tq, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:
        num_queries, num_keys = query.shape[2], key.shape[2]
        positions = torch.arange(num_keys, device=query.device)
        attention_mask = positions[None, :] <= positions[-num_queries:, None]
    # The dtype's minimum, not -inf: a query that sees no key (left padding while prefilling)
    # gets a uniform row instead of NaN, which padding never reads.
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
