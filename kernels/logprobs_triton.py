"""Fused LM-head log-prob/entropy in Triton: the CUDA backend of `kernels.logprobs`.

For hidden states h [N, d], head weight W [V, d] and per-row temperature tau [N], the logits are
z = (h @ W.T)[:, :vocab_size] / tau (as vLLM applies temperature); rows vocab_size..V-1 of W are
vocabulary padding and never enter the softmax. Outputs, in fp32 whatever the input dtype:
logprob = z[target] - lse and entropy = lse - E_p[z], both 0 where target == ignore_index.

Three kernels, none of which materialises [N, V]:
  forward      one program per BLOCK_N rows sweeps the vocabulary in BLOCK_V tiles (each tile a
               d-loop of BLOCK_D tl.dots), keeping an online max / sum-exp / sum-exp-weighted
               logit like flash attention; writes logprob, entropy and the row statistics.
  grad hidden  one program per BLOCK_N rows recomputes every logit tile, forms grad_z, and adds
               grad_z @ W_tile into its own rows of an fp32 [N, d] buffer.
  grad weight  one program per BLOCK_V vocabulary rows recomputes the logit tiles of every row
               block and adds grad_z.T @ h_tile into its own rows of an fp32 [V, d] buffer.
Each program owns the output rows it accumulates into and visits the other axis in a fixed
order, so the backward is deterministic without atomics, at the price of recomputing the
logits twice (10NdV FLOPs in all against 6NdV for three plain matmuls).

The ops are registered with torch.library (tandem::logprobs_fwd, tandem::logprobs_bwd_hidden,
tandem::logprobs_bwd_weight) so torch.compile treats them as opaque nodes with fake shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


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
def _row_state(
    t_ptr, tau_ptr, stats_ptr, glp_ptr, gent_ptr, rows, N, ignore_index,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
):  # fmt: skip
    """Per-row backward inputs: target, tau, lse, entropy, and the upstream gradients divided by
    tau (the chain rule through z = raw / tau) and zeroed on ignored and out-of-range rows."""
    row_mask = rows < N
    tgt = tl.load(t_ptr + rows, mask=row_mask, other=ignore_index)
    tau = tl.load(tau_ptr + rows, mask=row_mask, other=1.0)
    lse = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    ent = tl.load(stats_ptr + N + rows, mask=row_mask, other=0.0)
    live = row_mask & (tgt != ignore_index)
    c_lp = tl.zeros_like(tau)
    c_ent = tl.zeros_like(tau)
    if HAS_GLP:
        c_lp = tl.where(live, tl.load(glp_ptr + rows, mask=row_mask, other=0.0) / tau, 0.0)
    if HAS_GENT:
        c_ent = tl.where(live, tl.load(gent_ptr + rows, mask=row_mask, other=0.0) / tau, 0.0)
    return row_mask, tgt, tau, lse, ent, c_lp, c_ent


@triton.jit
def _grad_logits(
    z, cols, col_mask, tgt, lse, ent, c_lp, c_ent, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr
):
    """dL/d(raw logits) [BLOCK_N, BLOCK_V] for L = sum(g_lp * logprob + g_ent * entropy).

    d logprob/dz = onehot - p and d entropy/dz = -p (z - E_p[z]); z - E_p[z] is formed as
    (z - lse) + entropy, which stays small when the logits themselves are huge.
    """
    log_p = z - lse[:, None]
    p = tl.where(col_mask[None, :], tl.exp(log_p), 0.0)
    grad = tl.zeros_like(z)
    if HAS_GLP:
        onehot = (cols[None, :] == tgt[:, None]).to(tl.float32)
        grad += c_lp[:, None] * (onehot - p)
    if HAS_GENT:
        grad -= c_ent[:, None] * p * (log_p + ent[:, None])
    return grad


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


@triton.jit
def _accumulate_dot(
    out_rows, out_mask, a, b_rows, b_mask, d, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr
):
    """out[out_mask rows, :d] += a @ b[b_mask rows, :d], BLOCK_D columns at a time; `out_rows`
    and `b_rows` point at the rows' starts of row-major [*, d] tensors."""
    for k in range(0, d, BLOCK_D):
        offs = k + tl.arange(0, BLOCK_D)
        d_mask = offs < d
        b = tl.load(b_rows + offs[None, :], mask=b_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            b = b.to(tl.float32)
        mask = out_mask[:, None] & d_mask[None, :]
        out = out_rows + offs[None, :]
        acc = tl.load(out, mask=mask, other=0.0)
        tl.store(out, tl.dot(a, b, acc, input_precision="ieee"), mask=mask)
    # The next tile re-reads these accumulators, maybe through other threads of the program
    # (the load and store layouts are the compiler's choice): make the stores visible first.
    tl.debug_barrier()


@triton.jit
def _bwd_hidden_kernel(
    h_ptr, w_ptr, t_ptr, tau_ptr, stats_ptr, glp_ptr, gent_ptr, gh_ptr, N, d, vocab_size,
    ignore_index, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, tgt, tau, lse, ent, c_lp, c_ent = _row_state(
        t_ptr, tau_ptr, stats_ptr, glp_ptr, gent_ptr, rows, N, ignore_index, HAS_GLP, HAS_GENT
    )
    gh_rows = gh_ptr + rows.to(tl.int64)[:, None] * d
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < vocab_size
        z = _logit_tile(
            h_ptr, w_ptr, rows, cols, row_mask, col_mask, tau, d, BLOCK_N, BLOCK_V, BLOCK_D, UPCAST
        )
        grad = _grad_logits(z, cols, col_mask, tgt, lse, ent, c_lp, c_ent, HAS_GLP, HAS_GENT)
        # The matmul runs in the weight's dtype (bf16 tensor cores), accumulating in fp32.
        grad = grad.to(w_ptr.dtype.element_ty)
        if UPCAST:
            grad = grad.to(tl.float32)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * d
        _accumulate_dot(gh_rows, row_mask, grad, w_rows, col_mask, d, BLOCK_D, UPCAST)


@triton.jit
def _bwd_weight_kernel(
    h_ptr, w_ptr, t_ptr, tau_ptr, stats_ptr, glp_ptr, gent_ptr, gw_ptr, N, d, vocab_size,
    ignore_index, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < vocab_size
    gw_rows = gw_ptr + cols.to(tl.int64)[:, None] * d
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_mask, tgt, tau, lse, ent, c_lp, c_ent = _row_state(
            t_ptr, tau_ptr, stats_ptr, glp_ptr, gent_ptr, rows, N, ignore_index, HAS_GLP, HAS_GENT
        )
        z = _logit_tile(
            h_ptr, w_ptr, rows, cols, row_mask, col_mask, tau, d, BLOCK_N, BLOCK_V, BLOCK_D, UPCAST
        )
        grad = _grad_logits(z, cols, col_mask, tgt, lse, ent, c_lp, c_ent, HAS_GLP, HAS_GENT)
        grad_t = tl.trans(grad.to(h_ptr.dtype.element_ty))
        if UPCAST:
            grad_t = grad_t.to(tl.float32)
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * d
        _accumulate_dot(gw_rows, col_mask, grad_t, h_rows, row_mask, d, BLOCK_D, UPCAST)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> logprob [N], entropy [N], stats [2, N] = (lse, unmasked entropy), all fp32."""
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
def _(hidden, weight, targets, temperature, ignore_index, vocab_size, block_n, block_v, block_d):
    n = hidden.shape[0]
    logprob = hidden.new_empty(n, dtype=torch.float32)
    return logprob, torch.empty_like(logprob), hidden.new_empty((2, n), dtype=torch.float32)


def _bwd_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    stats: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, ...], dict[str, bool]]:
    """Leading kernel pointer args and the HAS_* flags; an absent gradient gets `stats` as an
    unread placeholder pointer."""
    glp = stats if grad_logprob is None else grad_logprob.float().contiguous()
    gent = stats if grad_entropy is None else grad_entropy.float().contiguous()
    flags = {"HAS_GLP": grad_logprob is not None, "HAS_GENT": grad_entropy is not None}
    return (hidden, weight, targets, temperature, stats, glp, gent), flags


@torch.library.custom_op("tandem::logprobs_bwd_hidden", mutates_args=())
def _logprobs_bwd_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    stats: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
    vocab_size: int,
    block_n: int,
    block_v: int,
    block_d: int,
) -> torch.Tensor:
    """-> grad of hidden [N, d] in hidden's dtype (accumulated in an fp32 buffer)."""
    n, d = hidden.shape
    args, flags = _bwd_args(hidden, weight, targets, temperature, stats, grad_logprob, grad_entropy)
    grad = torch.zeros(n, d, dtype=torch.float32, device=hidden.device)
    _bwd_hidden_kernel[(triton.cdiv(n, block_n),)](
        *args, grad, n, d, vocab_size, ignore_index, **flags,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, UPCAST=INTERPRET,
        **_launch_opts(block_n, block_v),
    )  # fmt: skip
    return grad.to(hidden.dtype)


@_logprobs_bwd_hidden.register_fake
def _(hidden, weight, targets, temperature, stats, grad_logprob, grad_entropy, *_):
    return torch.empty_like(hidden)


@torch.library.custom_op("tandem::logprobs_bwd_weight", mutates_args=())
def _logprobs_bwd_weight(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    stats: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
    vocab_size: int,
    block_n: int,
    block_v: int,
    block_d: int,
) -> torch.Tensor:
    """-> grad of weight [V, d] in weight's dtype; padded vocabulary rows get zeros."""
    n, d = hidden.shape
    args, flags = _bwd_args(hidden, weight, targets, temperature, stats, grad_logprob, grad_entropy)
    grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    _bwd_weight_kernel[(triton.cdiv(vocab_size, block_v),)](
        *args, grad, n, d, vocab_size, ignore_index, **flags,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, UPCAST=INTERPRET,
        **_launch_opts(block_n, block_v),
    )  # fmt: skip
    return grad.to(weight.dtype)


@_logprobs_bwd_weight.register_fake
def _(hidden, weight, targets, temperature, stats, grad_logprob, grad_entropy, *_):
    return torch.empty_like(weight)


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
    grads: list[torch.Tensor | None] = [None] * 9
    if grad_logprob is None and grad_entropy is None:
        return tuple(grads)
    args = (hidden, weight, targets, temperature, stats, grad_logprob, grad_entropy, *ctx.config)
    if ctx.needs_input_grad[0]:
        grads[0] = torch.ops.tandem.logprobs_bwd_hidden(*args)
    if ctx.needs_input_grad[1]:
        grads[1] = torch.ops.tandem.logprobs_bwd_weight(*args)
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
    block_n: int = 64,
    block_v: int = 128,
    block_d: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax((hidden @ weight.T)[:, :vocab_size] / tau).

    hidden [N, d] and weight [V, d] (bf16 or fp32, contiguous; V >= vocab_size, rows past
    vocab_size are padding), targets [N] int64 in [0, vocab_size) or == ignore_index,
    temperature [N] fp32 > 0 -> (logprob [N], entropy [N]) fp32, both 0 on ignored rows.
    Differentiable w.r.t. hidden and weight; backward saves only the inputs and [2, N] fp32
    row statistics. The block sizes are tile shapes (powers of two, >= 16 on a GPU).
    """
    n, d = hidden.shape
    assert weight.ndim == 2 and weight.shape[1] == d and 0 < vocab_size <= weight.shape[0]
    assert targets.shape == (n,) and targets.dtype == torch.long
    assert temperature.shape == (n,) and temperature.dtype == torch.float32
    assert hidden.is_contiguous() and weight.is_contiguous() and targets.is_contiguous()
    logprob, entropy, _ = torch.ops.tandem.logprobs_fwd(
        hidden, weight, targets, temperature.contiguous(), ignore_index, vocab_size,
        block_n, block_v, block_d,
    )  # fmt: skip
    return logprob, entropy
