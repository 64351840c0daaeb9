"""fused_logprobs against a naive full-logits reference: values and gradients."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_logprobs


def _reference(hidden, weight, targets, temperature):
    """Full [N, V] logits in fp64: the ground truth the fp32 kernel is measured against."""
    logits = (hidden.double() @ weight.double().T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)


def _inputs(num_tokens=37, dim=16, vocab=50, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_values_and_grads_match_reference(chunk_size: int, temperature: float) -> None:
    # fp32 inputs: the kernel accumulates in fp32, so compare against the same precision.
    hidden, weight, targets = _inputs(dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(2, hidden.shape[0], generator=gen)

    lp, ent = fused_logprobs(hidden, weight, targets, temperature, chunk_size)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == targets.shape
    grad_h, grad_w = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (hidden, weight))

    ref_lp, ref_ent = _reference(hidden, weight, targets, temperature)
    ref_h, ref_w = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (hidden, weight))

    for got, want in zip((lp, ent, grad_h, grad_w), (ref_lp, ref_ent, ref_h, ref_w), strict=True):
        _close(got, want)


@pytest.mark.parametrize("use", ["logprob", "entropy"])
def test_single_output_gradient(use: str) -> None:
    """Only one output feeds the loss: the other's gradient arrives as None and is skipped."""
    hidden, weight, targets = _inputs(dtype=torch.float32)
    lp, ent = fused_logprobs(hidden, weight, targets, 0.9, chunk_size=8)
    ref_lp, ref_ent = _reference(hidden, weight, targets, 0.9)
    out, ref = (lp, ref_lp) if use == "logprob" else (ent, ref_ent)
    grads = torch.autograd.grad(out.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads, strict=True):
        _close(got, want)


def test_gradcheck_float64() -> None:
    hidden, weight, targets = _inputs(num_tokens=7, dim=4, vocab=9)
    assert torch.autograd.gradcheck(
        lambda h, w: fused_logprobs(h, w, targets, 1.3, 3), (hidden, weight)
    )


def test_bf16_inputs_accumulate_in_fp32() -> None:
    hidden, weight, targets = _inputs(dtype=torch.bfloat16)
    lp, ent = fused_logprobs(hidden, weight, targets, 1.0, 16)
    ref_lp, ref_ent = _reference(hidden.detach(), weight.detach(), targets, 1.0)
    _close(lp, ref_lp)
    _close(ent, ref_ent)
    grad_h, grad_w = torch.autograd.grad((lp + ent).sum(), (hidden, weight))
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16


def test_rejects_bad_temperature() -> None:
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, targets, 0.0)


def test_leading_dims_and_strided_input() -> None:
    """[B, T, d] hidden sliced like hidden[:, :-1] -> outputs [B, T-1] that are not views."""
    hidden, weight, targets = _inputs(num_tokens=4 * 6, dtype=torch.float32)
    states = hidden.detach().view(4, 6, -1).requires_grad_()
    lp, ent = fused_logprobs(states[:, :-1], weight, targets.view(4, 6)[:, 1:], 1.2, 5)
    assert lp.shape == ent.shape == (4, 5) and lp._base is None and ent._base is None
    ref_lp, ref_ent = _reference(
        states[:, :-1].reshape(-1, states.shape[-1]),
        weight,
        targets.view(4, 6)[:, 1:].reshape(-1),
        1.2,
    )
    _close(lp.view(-1), ref_lp)
    _close(ent.view(-1), ref_ent)
    grads = torch.autograd.grad((lp + 2 * ent).sum(), (states, weight))
    ref_grads = torch.autograd.grad((ref_lp + 2 * ref_ent).sum(), (states, weight))
    for got, want in zip(grads, ref_grads, strict=True):
        _close(got, want)
