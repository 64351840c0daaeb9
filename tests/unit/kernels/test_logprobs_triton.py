"""The Triton log-prob/entropy path (Triton forward, chunked backward) against an fp64
full-logits reference.

Without a GPU the kernels run under the Triton interpreter; on a CUDA machine the compiled
kernels are tested instead. Triton chooses interpreter or compiler when a function is decorated
with @triton.jit, its own library (tl.sum, tl.zeros, ...) included, so TRITON_INTERPRET=1 must
be set before `import triton`, not merely before the first launch.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def _use_triton_interpreter() -> None:
    """Set TRITON_INTERPRET=1 and drop any Triton imported without it (the suite's conftest
    imports transformers, which imports triton), so the imports below redo it in interpreter
    mode. The C extension stays loaded; on a CPU-only machine nothing can run compiled Triton
    anyway, so the rest of the session loses nothing."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in list(sys.modules):
        stale_triton = name.partition(".")[0] == "triton" and not name.startswith("triton._C")
        if stale_triton or name == "kernels.logprobs_triton":
            del sys.modules[name]


if not torch.cuda.is_available():
    _use_triton_interpreter()

pytest.importorskip("triton", reason="triton is not installed (the CUDA kernel backend)")

import kernels.logprobs_triton as lt  # noqa: E402

# The module, not the package's `logprobs` function of the same name.
chunked = sys.modules["kernels.logprobs"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
# Small tiles so every mask is exercised: 37 rows = 2 full blocks + 5, vocabulary 197 of 203
# rows = 6 full tiles + 5 (+ 6 padding rows), d = 48 = one full d-tile + 16.
N, D, V, VOCAB = 37, 48, 203, 197
TILES = {"block_n": 16, "block_v": 32, "block_d": 32}
# The backward's chunks: 37 rows = 2 chunks of 16 + 5; 197 columns = 3 chunks of 64 + 5.
CHUNKS = {"chunk_size": 16, "vocab_chunk_size": 64}


def _inputs(dtype: torch.dtype = torch.float32, hidden_scale: float = 1.0, seed: int = 0):
    """hidden [N, D], weight [V, D] (both requiring grad), targets [N] with ignored rows,
    per-row temperatures [N]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=gen) * hidden_scale).to(DEVICE, dtype)
    weight = (torch.randn(V, D, generator=gen) / 2).to(DEVICE, dtype)
    targets = torch.randint(0, VOCAB, (N,), generator=gen)
    targets[[0, 5, 17, 36]] = IGNORE
    temperature = torch.empty(N).uniform_(0.5, 1.5, generator=gen)
    return (
        hidden.requires_grad_(),
        weight.requires_grad_(),
        targets.to(DEVICE),
        temperature.to(DEVICE),
    )


def _reference(hidden, weight, targets, temperature):
    """Full [N, VOCAB] logits in fp64, log_softmax, gather; 0 on ignored rows."""
    logits = (hidden.double() @ weight.double().T)[:, :VOCAB] / temperature.double()[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    live = targets != IGNORE
    logprob = logp.gather(1, torch.where(live, targets, 0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.where(live, logprob, 0.0), torch.where(live, entropy, 0.0)


def _kernel(hidden, weight, targets, temperature):
    return lt.triton_logprobs(
        hidden, weight, targets, temperature, IGNORE, VOCAB, **TILES, **CHUNKS
    )


def _grads(fn, inputs, g_lp, g_ent):
    """Values and d(sum g_lp*logprob + g_ent*entropy)/d(hidden, weight); a None g drops that
    output from the loss, so its upstream gradient never exists."""
    hidden, weight = inputs[:2]
    logprob, entropy = fn(*inputs)
    loss = sum((g * out).sum() for g, out in ((g_lp, logprob), (g_ent, entropy)) if g is not None)
    grads = torch.autograd.grad(loss, [t for t in (hidden, weight) if t.requires_grad])
    return logprob.detach(), entropy.detach(), grads


def _upstream(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g_lp, g_ent = torch.randn(2, N, generator=gen)
    return g_lp.to(DEVICE), g_ent.to(DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("which", ["both", "logprob", "entropy"])
def test_fp32_values_and_grads_match_fp64_reference(which: str) -> None:
    inputs = _inputs()
    g_lp, g_ent = _upstream()
    g_lp = None if which == "entropy" else g_lp
    g_ent = None if which == "logprob" else g_ent

    lp, ent, (gh, gw) = _grads(_kernel, inputs, g_lp, g_ent)
    ref_lp, ref_ent, (ref_gh, ref_gw) = _grads(_reference, inputs, g_lp, g_ent)

    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    _assert_close(lp, ref_lp, 1e-5)
    _assert_close(ent, ref_ent, 1e-5)
    assert gh.dtype == gw.dtype == torch.float32
    _assert_close(gh, ref_gh, 1e-4)
    _assert_close(gw, ref_gw, 1e-4)
    # Ignored rows: zero outputs, zero hidden gradient; padded vocabulary rows: zero gradient.
    ignored = inputs[2] == IGNORE
    assert not lp[ignored].any() and not ent[ignored].any() and not gh[ignored].any()
    assert not gw[VOCAB:].any()


def test_temperature_is_applied_per_row() -> None:
    hidden, weight, targets, temperature = _inputs()
    with torch.no_grad():
        lp, ent = _kernel(hidden, weight, targets, temperature)
        lp_hot, ent_hot = _kernel(hidden, weight, targets, temperature * 3)
    live = targets != IGNORE
    # Hotter sampling flattens every live row's distribution.
    assert (ent_hot[live] > ent[live]).all()
    ref_lp, _ = _reference(hidden, weight, targets, temperature * 3)
    _assert_close(lp_hot, ref_lp, 1e-5)


def test_bf16_inputs_within_bf16_tolerance() -> None:
    inputs = _inputs(torch.bfloat16)
    g_lp, g_ent = _upstream()
    lp, ent, (gh, gw) = _grads(_kernel, inputs, g_lp, g_ent)
    ref_lp, ref_ent, (ref_gh, ref_gw) = _grads(_reference, inputs, g_lp, g_ent)

    # Logits are exact fp32 sums of bf16 products, so the values keep fp32 accuracy; gradients
    # go through bf16 grad-logit tiles and come back in bf16.
    assert lp.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    _assert_close(lp, ref_lp, 1e-4)
    _assert_close(ent, ref_ent, 1e-4)
    for got, want in ((gh, ref_gh), (gw, ref_gw)):
        assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()


def test_huge_logits_stay_finite_and_correct() -> None:
    inputs = _inputs(hidden_scale=1e3)
    g_lp, g_ent = _upstream()
    lp, ent, (gh, gw) = _grads(_kernel, inputs, g_lp, g_ent)
    ref_lp, ref_ent, (ref_gh, ref_gw) = _grads(_reference, inputs, g_lp, g_ent)

    for got in (lp, ent, gh, gw):
        assert torch.isfinite(got).all()
    # Logits of order 1e4 carry fp32 rounding of order 1e-3: compare relative to the scale.
    assert ref_lp.abs().max() > 1e3
    _assert_close(lp / 1e4, ref_lp / 1e4, 1e-6)
    _assert_close(ent, ref_ent, 1e-3)
    # Backward recomputes each logit with another matmul (cuBLAS, not the forward's tl.dot):
    # a sum of D fp32 products of size |z| moves by up to about sqrt(D) eps |z|, and every
    # p = exp(z - lse) moves by as much relative to itself, and so do the gradients.
    hidden, weight, _, temperature = inputs
    logits = (hidden.double() @ weight.double().T)[:, :VOCAB] / temperature.double()[:, None]
    tol = D**0.5 * torch.finfo(torch.float32).eps * logits.abs().max().item()
    for got, want in ((gh, ref_gh), (gw, ref_gw)):
        assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_frozen_weight_gets_no_gradient_and_no_weight_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hidden, weight, targets, temperature = _inputs()
    weight.requires_grad_(False)
    operands = []  # the right operand's storage of each gradient matmul
    add_matmul = chunked._add_matmul
    monkeypatch.setattr(
        chunked,
        "_add_matmul",
        lambda out, a, b: operands.append(b.untyped_storage().data_ptr()) or add_matmul(out, a, b),
    )
    g_lp, g_ent = _upstream()
    _, _, (gh,) = _grads(_kernel, (hidden, weight, targets, temperature), g_lp, g_ent)
    _, _, (ref_gh,) = _grads(_reference, (hidden, weight, targets, temperature), g_lp, g_ent)
    _assert_close(gh, ref_gh, 1e-4)
    assert weight.grad is None
    # Grad hidden's matmuls multiply by weight tiles; only the weight gradient's would multiply
    # by a chunk of hidden.
    assert operands and weight.untyped_storage().data_ptr() in operands
    assert hidden.untyped_storage().data_ptr() not in operands


def test_backward_is_deterministic() -> None:
    inputs = _inputs()
    g_lp, g_ent = _upstream()
    _, _, (gh1, gw1) = _grads(_kernel, inputs, g_lp, g_ent)
    _, _, (gh2, gw2) = _grads(_kernel, inputs, g_lp, g_ent)
    assert torch.equal(gh1, gh2) and torch.equal(gw1, gw2)


def test_torch_compile_traces_through_the_custom_op() -> None:
    inputs = _inputs()
    g_lp, g_ent = _upstream()
    compiled = torch.compile(_kernel, backend="aot_eager", fullgraph=True)
    lp, ent, (gh, gw) = _grads(compiled, inputs, g_lp, g_ent)
    ref_lp, ref_ent, (ref_gh, ref_gw) = _grads(_kernel, inputs, g_lp, g_ent)
    for got, want in ((lp, ref_lp), (ent, ref_ent), (gh, ref_gh), (gw, ref_gw)):
        assert torch.equal(got, want)


def test_opcheck_schema_fake_and_autograd_registration() -> None:
    hidden, weight, targets, temperature = _inputs()
    args = (hidden, weight, targets, temperature, IGNORE, VOCAB, *TILES.values(), *CHUNKS.values())
    torch.library.opcheck(torch.ops.tandem.logprobs_fwd.default, args)
