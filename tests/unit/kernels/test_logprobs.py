"""The PyTorch path of `kernels.logprobs` against an fp64 full-logits reference."""

from __future__ import annotations

import pytest
import torch

from kernels import logprobs, naive_logprobs

IGNORE = -100


def _reference(hidden, weight, targets, temperature, vocab_size=None):
    """Full [N, V] logits in fp64, written out here: the ground truth for every case below."""
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    tau = torch.as_tensor(temperature, dtype=torch.float64).expand(targets.shape)
    logits = (hidden.double() @ weight[:vocab_size].double().T) / tau[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != IGNORE
    picked = logp.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return picked * valid, entropy * valid


def _inputs(num_tokens=37, dim=16, vocab=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden, weight, targets


def _upstream(num: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, num, generator=gen, dtype=torch.float64))


def _check(hidden, weight, targets, temperature, vocab_size=None, tol=1e-5, **sizes) -> None:
    """Values and gradients (random upstream gradients of both outputs) match the reference."""
    g_lp, g_ent = _upstream(targets.shape[0])
    lp, ent = logprobs(hidden, weight, targets, temperature, IGNORE, vocab_size=vocab_size, **sizes)
    assert lp.dtype == ent.dtype == torch.promote_types(hidden.dtype, torch.float32)
    grads = torch.autograd.grad(
        (lp * g_lp.to(lp.dtype) + ent * g_ent.to(lp.dtype)).sum(), (hidden, weight)
    )
    ref_lp, ref_ent = _reference(hidden, weight, targets, temperature, vocab_size)
    ref_grads = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (hidden, weight))
    for got, want in zip((lp, ent, *grads), (ref_lp, ref_ent, *ref_grads), strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("chunk_size", "vocab_chunk_size"), [(1, 1), (8, 7), (10, 50), (37, 13), (1024, 16384)]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_values_and_grads_match_fp64_reference(
    chunk_size: int, vocab_chunk_size: int, temperature: float
) -> None:
    # N = 37, d = 16, V = 50: not multiples of the chunk sizes.
    hidden, weight, targets = _inputs()
    _check(
        hidden,
        weight,
        targets,
        temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )


def test_per_token_temperature_ignored_rows_and_padded_vocabulary() -> None:
    hidden, weight, targets = _inputs(vocab=53)
    targets = targets.clamp(max=46)
    targets[[0, 5, 36]] = IGNORE
    temperature = torch.linspace(0.5, 1.5, targets.shape[0])
    _check(hidden, weight, targets, temperature, vocab_size=47, chunk_size=6, vocab_chunk_size=11)
    lp, ent = logprobs(hidden, weight, targets, temperature, IGNORE, vocab_size=47)
    assert lp[[0, 5, 36]].tolist() == [0.0] * 3 and ent[[0, 5, 36]].tolist() == [0.0] * 3
    grad_h, _ = torch.autograd.grad((lp + ent).sum(), (hidden, weight))
    assert grad_h[[0, 5, 36]].abs().sum() == 0.0


@pytest.mark.parametrize("offset", [0.0, -1e4])
def test_very_large_and_all_negative_logits_stay_exact(offset: float) -> None:
    hidden, weight, targets = _inputs(dim=8)
    # Logits in the thousands; with the offset every one is below -9000, where exp() of a
    # raw logit underflows to 0 and only the running max keeps the sums finite.
    hidden = torch.cat([hidden.detach() * 300, torch.ones(37, 1)], dim=1).requires_grad_()
    weight = torch.cat([weight.detach(), torch.full((50, 1), offset)], dim=1).requires_grad_()
    lp, ent = logprobs(hidden, weight, targets, 1.0, vocab_chunk_size=7)
    ref_lp, ref_ent = _reference(hidden.detach(), weight.detach(), targets, 1.0)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    # fp32 logits of magnitude ~1e4 carry ~1e-3 absolute rounding; the reference is fp64.
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=5e-3)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=5e-3)
    grads = torch.autograd.grad((lp + ent).sum(), (hidden, weight))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("use", ["logprob", "entropy"])
def test_single_output_gradient(use: str) -> None:
    """Only one output feeds the loss: the other's gradient arrives as None and is skipped."""
    hidden, weight, targets = _inputs()
    lp, ent = logprobs(hidden, weight, targets, 0.9, chunk_size=8, vocab_chunk_size=16)
    ref_lp, ref_ent = _reference(hidden, weight, targets, 0.9)
    out, ref = (lp, ref_lp) if use == "logprob" else (ent, ref_ent)
    grads = torch.autograd.grad(out.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_gradcheck_float64() -> None:
    hidden, weight, targets = _inputs(num_tokens=7, dim=4, vocab=9, dtype=torch.float64)
    targets[2] = IGNORE
    tau = torch.tensor([1.3, 0.8, 1.0, 2.0, 0.6, 1.1, 0.9], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs(h, w, targets, tau, IGNORE, chunk_size=3, vocab_chunk_size=4),
        (hidden, weight),
    )


def test_bf16_inputs_accumulate_in_fp32() -> None:
    hidden, weight, targets = _inputs(dtype=torch.bfloat16)
    lp, ent = logprobs(hidden, weight, targets, 1.0, vocab_chunk_size=16)
    ref_lp, ref_ent = _reference(hidden.detach(), weight.detach(), targets, 1.0)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=1e-5)
    grad_h, grad_w = torch.autograd.grad((lp + ent).sum(), (hidden, weight))
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16


def test_frozen_weight_gets_no_gradient_and_no_grad_keeps_nothing() -> None:
    hidden, weight, targets = _inputs()
    weight = weight.detach()
    lp, ent = logprobs(hidden, weight, targets)
    (lp + ent).sum().backward()
    assert hidden.grad is not None and weight.grad is None
    with torch.no_grad():
        lp, _ = logprobs(hidden, weight, targets)
    assert lp.grad_fn is None


def test_two_runs_give_identical_bits() -> None:
    runs = []
    for _ in range(2):
        hidden, weight, targets = _inputs(num_tokens=64, vocab=300)
        lp, ent = logprobs(hidden, weight, targets, 0.8, chunk_size=16, vocab_chunk_size=64)
        runs.append((lp, ent, *torch.autograd.grad((lp - ent).sum(), (hidden, weight))))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_naive_path_agrees_with_the_kernel() -> None:
    hidden, weight, targets = _inputs()
    targets[3] = IGNORE
    fused = logprobs(hidden, weight, targets, 0.7, IGNORE)
    naive = naive_logprobs(hidden, weight, targets, 0.7, IGNORE)
    for got, want in zip(fused, naive, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"backend": "cuda"}, "valid: auto, torch, triton"),
        ({"vocab_size": 60}, "vocab_size"),
        ({"chunk_size": 0}, "chunk sizes"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, match: str) -> None:
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=match):
        logprobs(hidden, weight, targets, **kwargs)


def test_out_of_range_target_is_rejected() -> None:
    hidden, weight, targets = _inputs()
    targets[0] = 50
    with pytest.raises(ValueError, match=r"targets must be in \[0, 50\)"):
        logprobs(hidden, weight, targets)


def test_leading_dims_and_strided_input() -> None:
    """[B, T, d] hidden sliced like hidden[:, :-1] -> outputs [B, T-1] that are not views."""
    hidden, weight, targets = _inputs(num_tokens=4 * 6)
    states = hidden.detach().view(4, 6, -1).requires_grad_()
    lp, ent = logprobs(states[:, :-1], weight, targets.view(4, 6)[:, 1:], 1.2, chunk_size=5)
    assert lp.shape == ent.shape == (4, 5) and lp._base is None and ent._base is None
    ref_lp, ref_ent = _reference(
        states[:, :-1].reshape(-1, states.shape[-1]),
        weight,
        targets.view(4, 6)[:, 1:].reshape(-1),
        1.2,
    )
    torch.testing.assert_close(lp.reshape(-1), ref_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.reshape(-1), ref_ent.float(), rtol=1e-5, atol=1e-5)
