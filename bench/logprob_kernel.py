"""The fused log-prob/entropy kernel against the naive full-logits path, side by side, on CPU.

    .venv/bin/python bench/logprob_kernel.py [N d V]      # default: 4096 896 151936 (Qwen2.5-0.5B head)

Forward + backward (random upstream gradients for both log-prob and entropy, gradients for
hidden and weight), fp32. Each path runs in its own child process, so its peak memory is its
own: "peak extra" is the resident-set high-water mark during forward + backward minus the
resident set just before (inputs allocated), and excludes nothing else, so the [V, d] weight
gradient both paths must produce is counted in both. Prints a markdown table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ("naive", "fused")


def _child(path: str, num_tokens: int, dim: int, vocab: int) -> dict:
    import torch

    from kernels import logprobs, naive_logprobs
    from rl.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    torch.manual_seed(0)
    hidden = (torch.randn(num_tokens, dim) * 0.05).requires_grad_()
    weight = (torch.randn(vocab, dim) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,))
    g_lp, g_ent = torch.randn(2, num_tokens)
    fn = naive_logprobs if path == "naive" else logprobs
    # Warm the allocator and the code paths on a slice, then reset the high-water mark.
    lp, ent = fn(hidden[:64], weight, targets[:64])
    torch.autograd.grad((lp * g_lp[:64] + ent * g_ent[:64]).sum(), (hidden, weight))
    del lp, ent
    reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    lp, ent = fn(hidden, weight, targets)
    forward_s = time.perf_counter() - start
    grads = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (hidden, weight))
    total_s = time.perf_counter() - start
    peak = peak_rss_bytes()
    checksum = [float(lp.double().sum()), float(ent.double().sum())]
    checksum += [float(g.double().abs().sum()) for g in grads]
    return {
        "forward_s": forward_s,
        "total_s": total_s,
        "peak_extra_mib": (peak - before) / (1 << 20),
        "checksum": checksum,
    }


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], *map(int, argv[2:5]))))
        return
    num_tokens, dim, vocab = map(int, argv) if argv else (4096, 896, 151936)
    results = {}
    for path in PATHS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", path, str(num_tokens), str(dim), str(vocab)],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        )
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    naive, fused = results["naive"], results["fused"]
    worst = max(
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(fused["checksum"], naive["checksum"], strict=True)
    )
    print(f"\nN={num_tokens} d={dim} V={vocab}, fp32, forward + backward, CPU\n")
    print("| path | forward s | forward + backward s | peak extra MiB |")
    print("|---|---|---|---|")
    for path in PATHS:
        r = results[path]
        print(f"| {path} | {r['forward_s']:.2f} | {r['total_s']:.2f} | {r['peak_extra_mib']:.0f} |")
    print(
        f"\nfused / naive: time {fused['total_s'] / naive['total_s']:.2f}x, peak extra memory "
        f"{fused['peak_extra_mib'] / naive['peak_extra_mib']:.1%}; "
        f"largest relative checksum difference {worst:.1e}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
