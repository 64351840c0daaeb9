"""Fused LM-head log-prob/entropy kernels that never materialise the [N, V] logits.

`logprobs` is the one entry point: it validates, drops ignored rows, and dispatches to the
chunked PyTorch path (CPU, and the reference) or the Triton path (CUDA). `naive_logprobs`
computes the same thing through full logits, for comparison (`trainer.logprob_impl=naive`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.logprobs import torch_logprobs

BACKENDS = ("auto", "torch", "triton")


def logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    backend: str = "auto",
    chunk_size: int = 512,
    vocab_chunk_size: int = 8192,
) -> tuple[Tensor, Tensor]:
    """Log-probability of `targets` and entropy under softmax(hidden @ weight.T / temperature).

    hidden [*S, d], weight [V, d] (any float dtype), targets [*S] long, temperature a float or
    a tensor [*S] (per-token, as vLLM applies each request's temperature) ->
    (logprob [*S], entropy [*S]) fp32 (fp64 for fp64 inputs), accumulated in fp32.
    Rows whose target is `ignore_index` get 0 for both and no gradient, and cost nothing.
    Columns at or beyond `vocab_size` (padding rows of the weight) are excluded.
    Differentiable w.r.t. hidden and weight for upstream gradients of either or both outputs;
    keeps only the inputs and two fp32 numbers per row for backward (nothing under no_grad).
    `backend`: "torch" (chunks of `chunk_size` rows x `vocab_chunk_size` columns, bounded
    workspace), "triton" (CUDA: a fused Triton forward, the backward in the same chunks), or
    "auto" (triton on CUDA, torch otherwise).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} mismatch")
    if targets.shape != hidden.shape[:-1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be long with shape {tuple(hidden.shape[:-1])}")
    if chunk_size <= 0 or vocab_chunk_size <= 0:
        raise ValueError(f"chunk sizes must be > 0, got {chunk_size}, {vocab_chunk_size}")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {weight.shape[0]}]")
    acc = torch.promote_types(weight.dtype, torch.float32)
    tau = torch.as_tensor(temperature, dtype=acc, device=hidden.device)
    tau = tau.expand(targets.shape).reshape(-1)
    flat_targets = targets.reshape(-1)
    live = flat_targets != ignore_index
    outside = live & ((flat_targets < 0) | (flat_targets >= vocab_size))
    # The checks and the number of kept rows in one read from the device: each read waits
    # for everything queued before it, once per call rather than once per check.
    counts = torch.stack([(~(tau > 0)).sum(), outside.sum(), live.sum()]).tolist()
    non_positive, num_outside, num_kept = counts
    if non_positive:
        raise ValueError("temperature must be > 0 for log-probs")
    if num_outside:
        raise ValueError(f"targets must be in [0, {vocab_size}) or equal ignore_index")
    keep = torch.nonzero_static(live, size=num_kept).squeeze(1)  # its size known: no read
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    kept_targets = flat_targets[keep]
    # index_select copies only the kept rows ([n_kept, d]); its backward scatters gradients
    # back, so ignored rows get exactly 0.
    args = (flat_hidden.index_select(0, keep), weight, kept_targets, 1.0 / tau[keep])
    if backend == "triton" or (backend == "auto" and hidden.is_cuda):
        from kernels.logprobs_triton import triton_logprobs

        kept = triton_logprobs(
            args[0], weight, kept_targets, tau[keep].float(), ignore_index, vocab_size,
            chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
        )  # fmt: skip
    else:
        kept = torch_logprobs(*args, vocab_size, chunk_size, vocab_chunk_size)
    # Scattered into fresh tensors of the targets' shape, never views: a view returned from an
    # FSDP module loses its pre-backward hook under in-place ops.
    where = torch.unravel_index(keep, targets.shape)
    logprob, entropy = (values.new_zeros(targets.shape).index_put(where, values) for values in kept)
    return logprob, entropy


def naive_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The same outputs as `logprobs` through the full [*S, V] logits (fp32, or fp64 inputs).

    The baseline the fused path is measured against; memory grows with N x V.
    """
    acc = torch.promote_types(weight.dtype, torch.float32)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    tau = torch.as_tensor(temperature, dtype=acc, device=hidden.device).expand(targets.shape)
    logits = (hidden.to(acc) @ weight[:vocab_size].to(acc).T) / tau[..., None]
    log_p = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    picked = log_p.gather(-1, torch.where(valid, targets, 0)[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return picked * valid, entropy * valid
