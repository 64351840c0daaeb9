"""Fused LM-head log-prob/entropy in Triton: the CUDA backend of `kernels.logprobs`.

For hidden states h [N, d], head weight W [V, d] and per-row temperature tau [N], the logits are
z = (h @ W.T)[:, :vocab_size] / tau (as vLLM applies temperature); rows vocab_size..V-1 of W are
vocabulary padding and never enter the softmax. Outputs, in fp32 whatever the input dtype:
logprob = z[target] - lse and entropy = lse - E_p[z], both 0 where target == ignore_index.

One Triton kernel, the forward: one program per BLOCK_N rows sweeps the vocabulary in BLOCK_V
tiles (each tile a d-loop of BLOCK_D tl.dots), keeping an online max / sum-exp /
sum-exp-weighted logit like flash attention, and writes logprob, entropy and the row
statistics; [N, V] never exists. The backward is the chunked PyTorch one
(`kernels.logprobs.chunked_grads`): it recomputes the logits in large tiles on cuBLAS and
multiplies each gradient tile into grad hidden and grad weight there. Backward Triton kernels
that owned their output rows and accumulated through global memory were several times slower
on an H200 (docs/benchmarks.md), and the row chunks' cuBLAS matmuls stay deterministic.

The forward is registered with torch.library (tandem::logprobs_fwd) so torch.compile treats it
as an opaque node with fake shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.logprobs import chunked_grads


@triton.jit
def _logit_tile(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, tau, d,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Temperature-scaled logits [BLOCK_N, BLOCK_V] in fp32; masked rows/cols read as zeros."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * d
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * d
    for k in range(0, d, BLOCK_D):
        offs = k + tl.arange(0, BLOCK_D)
        d_mask = offs < d
        h = tl.load(h_rows + offs[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs[None, :], mask=col_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee" only matters for fp32 inputs: without it they would silently run in tf32.
        acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
    return acc / tau[:, None]


@triton.jit
def _fwd_kernel(
    h_ptr, w_ptr, t_ptr, tau_ptr, lp_ptr, ent_ptr, stats_ptr, N, d, vocab_size, ignore_index,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(t_ptr + rows, mask=row_mask, other=ignore_index)
    tau = tl.load(tau_ptr + rows, mask=row_mask, other=1.0)
    # Online softmax over vocabulary tiles: m running max, s = sum e^(z-m),
    # a = sum e^(z-m) (z-m). Keeping a relative to m (not sum e^(z-m) z) means the entropy
    # log(s) - a/s never subtracts two large numbers when the logits are large.
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_tgt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < vocab_size
        z = _logit_tile(
            h_ptr, w_ptr, rows, cols, row_mask, col_mask, tau, d, BLOCK_N, BLOCK_V, BLOCK_D, UPCAST
        )
        # Every tile holds at least one real column, so m_new is finite from the first tile on.
        m_new = tl.maximum(m, tl.max(tl.where(col_mask[None, :], z, float("-inf")), axis=1))
        shifted = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(shifted), 0.0)
        scale = tl.exp(m - m_new)
        # Re-centre the old a on m_new; on the first tile s == 0 and m == -inf (0 * inf is NaN).
        recentre = tl.where(s > 0, m - m_new, 0.0) * s
        a = scale * (a + recentre) + tl.sum(e * shifted, axis=1)
        s = scale * s + tl.sum(e, axis=1)
        z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    log_s = tl.log(s)
    entropy = log_s - a / s
    live = tgt != ignore_index
    tl.store(lp_ptr + rows, tl.where(live, (z_tgt - m) - log_s, 0.0), mask=row_mask)
    tl.store(ent_ptr + rows, tl.where(live, entropy, 0.0), mask=row_mask)
    tl.store(stats_ptr + rows, m + log_s, mask=row_mask)
    tl.store(stats_ptr + N + rows, entropy, mask=row_mask)


# Triton picks interpreter or compiler from TRITON_INTERPRET when @triton.jit runs: for its own
# library (tl.sum, ...) at `import triton`, for these kernels at this module's import. Read the
# choice off a kernel so the flag can never disagree with it. The interpreter mishandles bf16
# tl.dot, so tiles are upcast to fp32 there (and only there).
INTERPRET: bool = isinstance(_fwd_kernel, InterpretedFunction)


def _launch_opts(block_n: int, block_v: int) -> dict[str, int]:
    """num_warps/num_stages for a logit tile of block_n x block_v fp32 (untuned guesses)."""
    return {"num_warps": 8 if block_n * block_v >= 8192 else 4, "num_stages": 3}


@torch.library.custom_op("tandem::logprobs_fwd", mutates_args=())
def _logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    block_n: int,
    block_v: int,
    block_d: int,
    chunk_size: int,
    vocab_chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logprob [N], entropy [N], stats [2, N] = (lse, unmasked entropy), all fp32.

    chunk_size and vocab_chunk_size are the backward's tiles, passed here so that its autograd
    context has them."""
    n, d = hidden.shape
    logprob = hidden.new_empty(n, dtype=torch.float32)
    entropy = torch.empty_like(logprob)
    stats = hidden.new_empty((2, n), dtype=torch.float32)
    _fwd_kernel[(triton.cdiv(n, block_n),)](
        hidden, weight, targets, temperature, logprob, entropy, stats, n, d, vocab_size,
        ignore_index, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, UPCAST=INTERPRET,
        **_launch_opts(block_n, block_v),
    )  # fmt: skip
    return logprob, entropy, stats


@_logprobs_fwd.register_fake
def _(hidden, weight, targets, temperature, *_):
    n = hidden.shape[0]
    logprob = hidden.new_empty(n, dtype=torch.float32)
    return logprob, torch.empty_like(logprob), hidden.new_empty((2, n), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, targets, temperature, *config = inputs
    _, _, stats = output
    ctx.save_for_backward(hidden, weight, targets, temperature, stats)
    ctx.config = config
    ctx.mark_non_differentiable(stats)
    # An output the loss never uses arrives as None, and its gradient term is skipped.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logprob, grad_entropy, _grad_stats) -> tuple[torch.Tensor | None, ...]:
    hidden, weight, targets, temperature, stats = ctx.saved_tensors
    ignore_index, vocab_size, _block_n, _block_v, _block_d, *chunks = ctx.config
    grads: list[torch.Tensor | None] = [None] * (4 + len(ctx.config))
    if grad_logprob is None and grad_entropy is None:
        return tuple(grads)
    # Ignored rows output constant zeros: whatever gradient reaches them goes no further.
    live = targets != ignore_index
    grad_logprob, grad_entropy = (
        None if g is None else torch.where(live, g.float(), 0.0)
        for g in (grad_logprob, grad_entropy)
    )
    lse, entropy = stats
    grads[0], grads[1] = chunked_grads(
        hidden, weight, targets, 1.0 / temperature, lse, lse - entropy, grad_logprob, grad_entropy,
        ctx.needs_input_grad[0], ctx.needs_input_grad[1], vocab_size, *chunks,
    )  # fmt: skip
    return tuple(grads)


_logprobs_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    *,
    chunk_size: int,
    vocab_chunk_size: int,
    block_n: int = 64,
    block_v: int = 128,
    block_d: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax((hidden @ weight.T)[:, :vocab_size] / tau).

    hidden [N, d] and weight [V, d] (bf16 or fp32, contiguous; V >= vocab_size, rows past
    vocab_size are padding), targets [N] int64 in [0, vocab_size) or == ignore_index,
    temperature [N] fp32 > 0 -> (logprob [N], entropy [N]) fp32, both 0 on ignored rows.
    Differentiable w.r.t. hidden and weight; backward saves only the inputs and [2, N] fp32
    row statistics, and recomputes the logits in chunk_size x vocab_chunk_size tiles. The
    block sizes are the forward kernel's tile shapes (powers of two, >= 16 on a GPU).
    """
    n, d = hidden.shape
    assert weight.ndim == 2 and weight.shape[1] == d and 0 < vocab_size <= weight.shape[0]
    assert targets.shape == (n,) and targets.dtype == torch.long
    assert temperature.shape == (n,) and temperature.dtype == torch.float32
    assert hidden.is_contiguous() and weight.is_contiguous() and targets.is_contiguous()
    logprob, entropy, _ = torch.ops.tandem.logprobs_fwd(
        hidden, weight, targets, temperature.contiguous(), ignore_index, vocab_size,
        block_n, block_v, block_d, chunk_size, vocab_chunk_size,
    )  # fmt: skip
    return logprob, entropy
