"""Chunked log-prob/entropy of the LM head: the PyTorch reference path (CPU and any device).

For hidden states h [N, d], head weight W [V, d] and temperature tau, the logits are
z = h @ W.T / tau (as vLLM applies temperature). The full [N, V] logits never exist: tokens are
processed `chunk_size` at a time, so the extra workspace is a few [chunk_size, V] fp32 tensors
in forward and backward. Backward recomputes each chunk's logits instead of saving them.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for bf16/fp16/fp32, fp64 kept (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(
    hidden: torch.Tensor, weight_acc: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[n, d] x [V, d] -> temperature-scaled logits [n, V], shifted so each row's max is 0.

    The shift cancels in every output but keeps the entropy terms small: H = lse - E_p[z] loses
    digits when both are large, not when the logits are centred near the mode.
    """
    logits = (hidden.to(weight_acc.dtype) @ weight_acc.T) / temperature
    return logits - logits.amax(dim=-1, keepdim=True)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weight_acc = weight.to(_acc_dtype(weight.dtype))
        # Outputs are allocated in the targets' shape, so callers never get a view (a view
        # returned from an FSDP module loses its pre-backward hook under in-place ops).
        logprob_out = hidden.new_empty(targets.shape, dtype=weight_acc.dtype)
        entropy_out = torch.empty_like(logprob_out)
        logprob, entropy = logprob_out.view(-1), entropy_out.view(-1)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_targets = targets.reshape(-1)
        lse = torch.empty_like(logprob)
        for start in range(0, flat_hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(flat_hidden[rows], weight_acc, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            probs = torch.exp(logits - chunk_lse[:, None])
            lse[rows] = chunk_lse
            logprob[rows] = logits.gather(1, flat_targets[rows, None]).squeeze(1) - chunk_lse
            # H = lse - E_p[z]: exact for any logits, no log(0) on underflowed probabilities.
            entropy[rows] = chunk_lse - (probs * logits).sum(dim=-1)
        # The inputs are saved as given: flattening a strided one (hidden[:, :-1]) copies it.
        ctx.save_for_backward(hidden, weight, targets, lse)
        # An output nobody differentiates (e.g. entropy with no bonus) arrives as None in
        # backward, and its [chunk, V] gradient term is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprob_out, entropy_out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden_in, weight, targets, lse = ctx.saved_tensors
        hidden, targets = hidden_in.reshape(-1, hidden_in.shape[-1]), targets.reshape(-1)
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        if grad_logprob is not None:
            grad_logprob = grad_logprob.reshape(-1)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1)
        weight_acc = weight.to(_acc_dtype(weight.dtype))
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight_acc) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight_acc, temperature)
            probs = torch.exp(logits - lse[rows, None])
            # d(logprob)/dz = onehot(target) - p ;  dH/dz = -p * (z - E_p[z]).
            grad_logits = torch.zeros_like(logits)
            if grad_logprob is not None:
                g = grad_logprob[rows, None].to(logits.dtype)
                grad_logits -= g * probs
                grad_logits.scatter_add_(1, targets[rows, None], g)
            if grad_entropy is not None:
                expected = (probs * logits).sum(dim=-1, keepdim=True)
                grad_logits -= (
                    grad_entropy[rows, None].to(logits.dtype) * probs * (logits - expected)
                )
            grad_logits /= temperature  # chain rule through z = raw_logits / tau
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight_acc).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows].to(logits.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden_in.shape)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and entropy under softmax(hidden @ weight.T / temperature).

    hidden [N, d], weight [V, d] (any float dtype), targets [N] long ->
    (logprob [N], entropy [N]) in fp32 (fp64 for fp64 inputs), accumulated in that dtype.
    Leading dims are allowed: hidden [*S, d] and targets [*S] give outputs [*S]. Differentiable w.r.t. hidden and weight; the backward
    accepts upstream gradients for both outputs. Peak extra memory is O(chunk_size * V).
    """
    assert weight.ndim == 2 and hidden.shape[-1] == weight.shape[1]
    assert targets.shape == hidden.shape[:-1] and targets.dtype == torch.long
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    return _FusedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_size))
