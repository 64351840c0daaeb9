"""The LM-head log-prob/entropy paths on a GPU: speed, peak memory, correctness.

    python bench/gpu_kernels.py                # CUDA machine: check + table, under 5 minutes
    python bench/gpu_kernels.py --check-only   # only the small fp32 check (CPU: interpreter)

At bf16, N=16384 tokens and the LM heads of Qwen2.5-7B (d=3584, V=152064) and Qwen2.5-0.5B
(d=896, V=151936) it times one forward+backward, with random upstream gradients for both
logprob and entropy, and one no-grad forward, of (a) the Triton path (fused Triton forward,
chunked backward) and (b) the chunked PyTorch path (cuBLAS matmuls with fp32 outputs), each at
three chunk shapes, (c) torch.compile of the chunked path, (d) the naive path through the full
[N, V] logits, and (e) cuBLAS doing just the three matmuls of the same shapes (6NdV FLOPs),
and prints markdown tables for
docs/benchmarks.md. First it checks Triton against the PyTorch path at a small shape in fp32
and bf16 (against fp64 too). The fp32 check alone runs on a CPU-only machine, under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

IGNORE = -100
SHAPES = ((3584, 152064), (896, 151936))  # LM heads (d, V) of Qwen2.5-7B and Qwen2.5-0.5B
Fn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def naive(hidden, weight, targets, temperature, vocab_size):
    """The baseline: full fp32 logits [N, vocab_size], log_softmax, gather, entropy."""
    logits = (hidden @ weight[:vocab_size].T).float() / temperature[:, None]
    log_p = torch.log_softmax(logits, dim=-1)
    live = targets != IGNORE
    logprob = log_p.gather(1, torch.where(live, targets, 0)[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return logprob * live, entropy * live


def dispatched(backend: str, **chunks: int) -> Fn:
    """The package entry point on one backend ("torch": chunked PyTorch, "triton"); `chunks`
    are its chunk_size / vocab_chunk_size."""
    from kernels import logprobs

    def fn(hidden, weight, targets, temperature, vocab_size):
        return logprobs(
            hidden,
            weight,
            targets,
            temperature,
            IGNORE,
            vocab_size=vocab_size,
            backend=backend,
            **chunks,
        )

    return fn


def triton_direct(chunk_size: int, vocab_chunk_size: int) -> Fn:
    """The Triton path without the dispatcher's validation and ignored-row gather."""
    from kernels.logprobs_triton import triton_logprobs

    def fn(hidden, weight, targets, temperature, vocab_size):
        return triton_logprobs(
            hidden, weight, targets, temperature, IGNORE, vocab_size,
            chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
        )  # fmt: skip

    return fn


def make_inputs(n, d, v, vocab_size, dtype, device, seed=0, ignored=0.1):
    """hidden [n, d] and weight [v, d] requiring grad, targets [n] in [0, vocab_size) (a
    fraction ignored), per-row temperatures [n], upstream gradients (g_lp, g_ent) [n]."""
    gen = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(v, d, generator=gen, device=device, dtype=dtype) / d**0.5
    targets = torch.randint(0, vocab_size, (n,), generator=gen, device=device)
    targets[torch.rand(n, generator=gen, device=device) < ignored] = IGNORE
    temperature = torch.rand(n, generator=gen, device=device) + 0.5
    grads = torch.randn(2, n, generator=gen, device=device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, temperature, grads


def fwd_bwd(fn: Fn, inputs, vocab_size: int) -> list[torch.Tensor]:
    """One forward+backward; returns [logprob, entropy, grad_hidden, grad_weight]."""
    hidden, weight, targets, temperature, (g_lp, g_ent) = inputs
    hidden.grad = weight.grad = None
    logprob, entropy = fn(hidden, weight, targets, temperature, vocab_size)
    torch.autograd.backward((logprob, entropy), (g_lp, g_ent))
    return [logprob.detach(), entropy.detach(), hidden.grad, weight.grad]


def check(
    device: str,
    n: int,
    d: int,
    v: int,
    vocab_size: int,
    dtype: torch.dtype,
    backends: tuple[str, ...] = ("triton", "torch"),
) -> str:
    """Max abs differences: each of `backends` against the others and against fp64 on the same
    (rounded) inputs (markdown). At bf16 on CUDA the PyTorch path's matmuls are cuBLAS's, with
    fp32 outputs."""
    inputs = make_inputs(n, d, v, vocab_size, dtype, device)
    results = {backend: fwd_bwd(dispatched(backend), inputs, vocab_size) for backend in backends}
    hidden, weight, *rest = inputs
    as64 = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    results["fp64"] = fwd_bwd(naive, (*as64, *rest), vocab_size)
    lines = [
        f"{dtype} check, N={n} d={d} V={v} vocab_size={vocab_size}, {device}: max abs difference",
        "",
        "| pair | logprob | entropy | grad hidden | grad weight |",
        "|---|---|---|---|---|",
    ]
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            diffs = [
                (x.double() - y.double()).abs().max().item()
                for x, y in zip(results[a], results[b], strict=True)
            ]
            lines.append(f"| {a} vs {b} | " + " | ".join(f"{x:.2e}" for x in diffs) + " |")
    return "\n".join(lines)


def synchronize(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (CUDA; CPU work is done when its call returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn: Callable[[], object], iters: int, device: torch.device | str) -> float:
    """Mean ms of `iters` calls of `fn`, timed from an idle device to an idle device."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / iters


def measure(fn: Fn, inputs, vocab_size: int, iters: int) -> tuple[float, float]:
    """(ms per forward+backward, peak GiB allocated above the inputs: CUDA only, else NaN)
    after one warm-up."""
    device = inputs[0].device
    fwd_bwd(fn, inputs, vocab_size)
    inputs[0].grad = inputs[1].grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = elapsed_ms(lambda: fwd_bwd(fn, inputs, vocab_size), iters, device)
    gib = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return ms, gib


def measure_cublas(
    n: int, d: int, v: int, iters: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> float:
    """ms for logits = h @ W.T, grad_h = G @ W and grad_W = G.T @ h (6NdV FLOPs): cuBLAS on
    CUDA, the same three products on any device."""
    h = torch.randn(n, d, device=device, dtype=dtype)
    w = torch.randn(v, d, device=device, dtype=dtype)
    g = torch.randn(n, v, device=device, dtype=dtype)

    def three() -> None:
        (h @ w.T, g @ w, g.T @ h)

    three()
    return elapsed_ms(three, iters, device)


def measure_naive(n: int, d: int, v: int, iters: int) -> tuple[float, float, str]:
    """Naive path at n rows, or, if that runs out of memory, at the largest n / 2**k (k <= 6)
    that fits, scaled linearly to n (its time and memory are dominated by the [n, V] logits)."""
    rows = n
    while rows >= max(1, n // 64):
        # Here, not in the handler: the traceback there still holds the failed attempt's tensors.
        torch.cuda.empty_cache()
        try:
            ms, gib = measure(naive, make_inputs(rows, d, v, v, torch.bfloat16, "cuda"), v, iters)
        except torch.cuda.OutOfMemoryError:
            rows //= 2
            continue
        note = "" if rows == n else f"estimated from N={rows} (OOM at N={n})"
        return ms * n / rows, gib * n / rows, note
    return float("nan"), float("nan"), f"OOM even at N={n // 64}"


# rows x vocabulary columns: the trainer's default, and two of the large ones measured best.
CHUNKS = ((512, 8192), (4096, 32768), (16384, 8192))


def measure_forward(fn: Fn, inputs, vocab_size: int, iters: int) -> float:
    """ms per forward under no_grad (what old log-probs and the reference cost), after one
    warm-up."""
    hidden, weight, targets, temperature, _ = inputs
    with torch.no_grad():
        fn(hidden, weight, targets, temperature, vocab_size)
        return elapsed_ms(
            lambda: fn(hidden, weight, targets, temperature, vocab_size), iters, hidden.device
        )


def benchmark(n: int, d: int, v: int, iters: int, compile_torch: bool) -> str:
    """The markdown table at bf16 [n, d] x [v, d]."""
    paths: list[tuple[str, Fn]] = []
    for rows, cols in CHUNKS:
        name = f"Triton forward, chunked backward, chunks {rows} x {cols}"
        paths.append((name, triton_direct(rows, cols)))
        fn = dispatched("torch", chunk_size=rows, vocab_chunk_size=cols)
        paths.append((f"chunked PyTorch (cuBLAS), chunks {rows} x {cols}", fn))
    if compile_torch:
        # Few, large chunks: Dynamo unrolls the chunk loops, so compile time grows with their
        # number (the default 512 x 8192 chunks would make hundreds of tiles each way).
        chunks = {"chunk_size": 4096, "vocab_chunk_size": 32768}
        name = "torch.compile(chunked PyTorch), chunks 4096 x 32768"
        paths.append((name, torch.compile(dispatched("torch", **chunks))))
    rows = []
    for name, fn in paths:
        tic = time.perf_counter()
        torch.cuda.empty_cache()
        inputs = make_inputs(n, d, v, v, torch.bfloat16, "cuda")
        ms, gib = measure(fn, inputs, v, iters)
        forward = measure_forward(fn, inputs, v, iters)
        del inputs
        note = f"incl. warm-up/compile: {time.perf_counter() - tic:.0f} s wall"
        rows.append((name, ms, forward, gib, note))
        print(f"{name}: {ms:.1f} ms ({forward:.1f} forward), {gib:.2f} GiB", file=sys.stderr)
    naive_ms, naive_gib, naive_note = measure_naive(n, d, v, iters)
    rows.append(
        ("naive (bf16 logits, fp32 softmax)", naive_ms, float("nan"), naive_gib, naive_note)
    )
    cublas = measure_cublas(n, d, v, iters)
    rows.append(("cuBLAS: the 3 matmuls only", cublas, float("nan"), float("nan"), "6NdV FLOPs"))
    tflops = 6 * n * d * v / (cublas * 1e-3) / 1e12
    lines = [
        f"bf16, N={n}, d={d}, V={v}, forward+backward of logprob and entropy, "
        f"mean of {iters} after warm-up; {torch.cuda.get_device_name()}; "
        f"cuBLAS at {tflops:.0f} TFLOP/s",
        "",
        "| path | fwd+bwd ms | x cuBLAS | forward ms | peak GiB above inputs | x naive peak "
        "| note |",
        "|---|---:|---:|---:|---:|---:|---|",
        *(
            f"| {name} | {ms:.1f} | {ms / cublas:.2f} | {fwd:.1f} | {gib:.2f} "
            f"| {gib / naive_gib:.3f} | {note} |"
            for name, ms, fwd, gib, note in rows
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="only the fp32 check")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (c)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.check_only:
        sys.exit("bench/gpu_kernels.py needs CUDA; without it only --check-only runs")
    if not cuda:
        # Triton reads this when it is first imported, which happens only below.
        os.environ["TRITON_INTERPRET"] = "1"
    # The GPU machine has torch and triton but not this package installed: import it from the
    # checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if cuda:
        for dtype in (torch.float32, torch.bfloat16):
            print(check("cuda", 1000, 256, 4099, 4000, dtype), "\n")
    else:  # the interpreter is slow: a smaller shape
        print(check("cpu", 70, 72, 300, 290, torch.float32))
    if not args.check_only:
        for d, v in SHAPES:
            print(benchmark(16384, d, v, args.iters, not args.no_compile), "\n")


if __name__ == "__main__":
    main()
