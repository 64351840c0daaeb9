"""Chunked log-prob/entropy of the LM head: the PyTorch path (CPU, and the reference).

For hidden states h [N, d], head weight W [V, d] and per-row temperature tau [N], the logits
are z = (h @ W.T)[:, :vocab_size] / tau (vLLM divides the logits by the temperature before
its log-softmax). The [N, V] logits never exist: rows are processed `chunk_size` at a time
and the vocabulary `vocab_chunk_size` columns at a time, with an online (running-max)
log-sum-exp, so the workspace is a few [chunk_size, vocab_chunk_size] fp32 tensors. Backward
recomputes each tile's logits from the saved inputs and two fp32 numbers per row, vocabulary
tile by vocabulary tile, so a tile's weight gradient is complete before the next starts and no
fp32 [V, d] buffer is needed.

The matmuls run at the operands' precision with fp32 accumulation and an fp32 result: on CUDA
bf16/fp16 operands go to cuBLAS's tensor cores (`torch.mm(..., out_dtype=torch.float32)`), as
the logits of a bf16 model are computed anyway; an fp32 matmul there would run at a small
fraction of the tensor-core rate. The logit gradient tile is rounded to the weight's dtype
before its two matmuls, as a bf16 model's own backward would.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for bf16/fp16/fp32, fp64 kept (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _tiles(num: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, num)) for start in range(0, num, size)]


def _tensor_cores(a: Tensor) -> bool:
    """Whether cuBLAS multiplies `a` as it is, with an fp32 output (bf16/fp16 on CUDA)."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b accumulated in fp32 (fp64 for fp64) and returned at that precision.

    A plain bf16 matmul would round its fp32 sums to bf16. cuBLAS takes bf16/fp16 operands with
    an fp32 output; elsewhere (CPU has no such kernel) the operands are upcast, which computes
    the same exact products and fp32 sums.
    """
    acc = _acc_dtype(a.dtype)
    if _tensor_cores(a):
        return torch.mm(a, b, out_dtype=acc)
    return a.to(acc) @ b.to(acc)


def _add_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b at out's (fp32 or fp64) precision, as `_matmul` computes it; in place
    where the device allows (addmm_), so the gradient buffers take no temporaries on CPU."""
    if _tensor_cores(a):
        out += _matmul(a, b)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _tile_logits(hidden: Tensor, weight_tile: Tensor, inv_tau: Tensor) -> Tensor:
    """hidden [n, d] x weight_tile [v, d] -> temperature-scaled logits [n, v], fp32."""
    return _matmul(hidden, weight_tile.T).mul_(inv_tau[:, None])


def _forward_rows(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_tau: Tensor,
    vocab_size: int,
    vocab_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """One row chunk: (logprob, entropy, lse) [n], with an online log-sum-exp over the vocab.

    The running sums are kept relative to the running max m: s = sum exp(z - m) and
    c = sum exp(z - m) (z - m). Then lse = m + log s and H = log s - c / s, which never
    subtracts two large numbers, so entropy stays exact for logits in the thousands.
    """
    acc = _acc_dtype(weight.dtype)
    n = hidden.shape[0]
    m = torch.full((n,), -torch.inf, dtype=acc, device=hidden.device)
    s = torch.zeros(n, dtype=acc, device=hidden.device)
    c = torch.zeros_like(s)
    target_logit = torch.zeros_like(s)
    for cols in _tiles(vocab_size, vocab_chunk):
        z = _tile_logits(hidden, weight[cols], inv_tau)
        local = targets - cols.start
        inside = (local >= 0) & (local < z.shape[1])
        picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
        target_logit = torch.where(inside, picked, target_logit)
        m_new = torch.maximum(m, z.amax(dim=1))
        shift = m - m_new  # <= 0; -inf on the first tile, where s = c = 0
        scale = torch.exp(shift)
        c = scale * (c + torch.nan_to_num(shift, neginf=0.0) * s)
        s = scale * s
        # In place from here: the tile is the workspace, and each pass over it costs time.
        centred = z.sub_(m_new[:, None])
        e = centred.exp()
        s = s + e.sum(dim=1)
        c = c + e.mul_(centred).sum(dim=1)
        m = m_new
    log_s = torch.log(s)
    lse = m + log_s
    return target_logit - lse, log_s - c / s, lse


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_tau: Tensor,
        vocab_size: int,
        chunk_size: int,
        vocab_chunk: int,
    ) -> tuple[Tensor, Tensor]:
        acc = _acc_dtype(weight.dtype)
        num_rows = hidden.shape[0]
        logprob = hidden.new_empty(num_rows, dtype=acc)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        for rows in _tiles(num_rows, chunk_size):
            logprob[rows], entropy[rows], lse[rows] = _forward_rows(
                hidden[rows], weight, targets[rows], inv_tau[rows], vocab_size, vocab_chunk
            )
        # Two fp32 numbers per row: E_p[z] = lse - H is what the entropy gradient needs.
        ctx.save_for_backward(hidden, weight, targets, inv_tau, lse, lse - entropy)
        # An output nobody differentiates (entropy without a bonus) arrives as None in
        # backward and its gradient term is skipped.
        ctx.set_materialize_grads(False)
        ctx.sizes = (vocab_size, chunk_size, vocab_chunk)
        return logprob, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprob: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, inv_tau, lse, mean_logit = ctx.saved_tensors
        grad_hidden, grad_weight = chunked_grads(
            hidden, weight, targets, inv_tau, lse, mean_logit, grad_logprob, grad_entropy,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], *ctx.sizes,
        )  # fmt: skip
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_tau: Tensor,
    lse: Tensor,
    mean_logit: Tensor,
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    need_hidden: bool,
    need_weight: bool,
    vocab_size: int,
    chunk_size: int,
    vocab_chunk: int,
) -> tuple[Tensor | None, Tensor | None]:
    """(grad of hidden, grad of weight), each in its input's dtype or None where not needed,
    of sum(g_lp * logprob + g_ent * entropy), recomputing the logits tile by tile.

    lse and mean_logit = E_p[z] = lse - entropy are the forward's fp32 row statistics; a row
    whose target is outside [0, vocab_size) gets no logprob term (its g_lp should be 0 anyway).
    Vocabulary tiles are the outer loop, so a tile's weight gradient is complete before the
    next starts; padded vocabulary rows (past vocab_size) get zeros.
    """
    acc = _acc_dtype(weight.dtype)
    grad_hidden = torch.zeros_like(hidden, dtype=acc) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    for cols in _tiles(vocab_size, vocab_chunk):
        w = weight[cols]
        grad_w = None
        if grad_weight is not None:
            # fp32 (fp64) weights take their gradient in place; bf16 ones accumulate a tile in
            # fp32 first, rounded once when complete.
            in_place = grad_weight.dtype == acc
            grad_w = grad_weight[cols] if in_place else torch.zeros_like(w, dtype=acc)
        for rows in _tiles(hidden.shape[0], chunk_size):
            h = hidden[rows]
            z = _tile_logits(h, w, inv_tau[rows])
            # grad_z = [g_lp (onehot - p) - g_ent p (z - E_p z)] / tau, built in place in the
            # logits tile (d logprob/dz = onehot - p, dH/dz = -p (z - E_p z)):
            # first p (-g_lp - g_ent (z - E_p z)), then + g_lp at each row's target.
            p = (z - lse[rows, None]).exp_()
            if grad_entropy is not None:
                z.sub_(mean_logit[rows, None]).mul_(-grad_entropy[rows, None].to(acc))
            else:
                z.zero_()
            if grad_logprob is not None:
                g = grad_logprob[rows].to(acc)
                z.sub_(g[:, None])
            grad_z = z.mul_(p)
            if grad_logprob is not None:
                # + g_lp at the target of each row whose target is in this tile; other rows
                # add 0 at a clamped column. No data-dependent shape (as nonzero's), so the
                # host never waits for the device here.
                local = targets[rows] - cols.start
                inside = (local >= 0) & (local < z.shape[1])
                column = local.clamp(0, z.shape[1] - 1)[:, None]
                grad_z.scatter_add_(1, column, torch.where(inside, g, 0.0)[:, None])
            # Chain rule through z = raw / tau; the two matmuls run at the weight's precision.
            grad_z = grad_z.mul_(inv_tau[rows, None]).to(weight.dtype)
            if grad_hidden is not None:
                _add_matmul(grad_hidden[rows], grad_z, w)
            if grad_w is not None:
                _add_matmul(grad_w, grad_z.T, h)
        if grad_weight is not None and not in_place:
            grad_weight[cols] = grad_w
    return None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight


def torch_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    vocab_size: int,
    chunk_size: int,
    vocab_chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """hidden [N, d], weight [V, d], targets [N] (all valid), 1/tau [N] -> (logprob, entropy) [N].

    fp32 outputs (fp64 for fp64 inputs). Callers go through `kernels.logprobs`, which
    validates arguments and drops ignored rows.
    """
    return _ChunkedLogprobs.apply(
        hidden, weight, targets, inv_temperature, vocab_size, chunk_size, vocab_chunk_size
    )
