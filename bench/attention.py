"""SDPA against `kernels.attention`'s explicit product, on the shapes Tandem's CPU runs hit.

    .venv/bin/python bench/attention.py [--rounds 5] [--threads 2] [--write-docs]

Each case is one attention call with GQA (2 query heads per key head) and SDPA's boolean
causal mask, timed forward + backward (training) or forward only (decoding, prefilling),
both paths taking turns. The last column says which one `kernels.attention` runs there
(`uses_explicit_product`): it should be the faster. Raw results go to
.cache/bench/attention.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch
from docs_section import write_section
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kernels.attention import explicit_product, uses_explicit_product

RESULTS = Path(__file__).resolve().parents[1] / ".cache" / "bench" / "attention.json"


class Case(NamedTuple):
    name: str
    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int
    backward: bool


CASES = [
    Case("tiny train (1M, 128 rows)", 128, 4, 18, 18, 32, True),
    Case("25M train (32 rows)", 32, 8, 140, 140, 64, True),
    Case("train, 192 tokens", 21, 8, 192, 192, 64, True),
    Case("train, 256 tokens", 16, 8, 256, 256, 64, True),
    Case("train, 512 tokens", 8, 8, 512, 512, 64, True),
    Case("25M decode (256 rows)", 256, 8, 1, 140, 64, False),
    Case("25M prefill (256 rows)", 256, 8, 12, 12, 64, False),
]


def _module(groups: int) -> nn.Module:
    module = nn.Module()
    module.num_key_value_groups = groups
    return module


def _explicit(module, q, k, v, mask):
    return explicit_product(q, k, v, mask, scaling=q.shape[-1] ** -0.5)


def _sdpa(module, q, k, v, mask):
    return sdpa_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


def time_case(case: Case, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Median milliseconds of each path on `case`."""
    gen = torch.Generator().manual_seed(0)
    kv_heads = case.heads // 2
    shapes = [(case.batch, case.heads, case.queries)] + [(case.batch, kv_heads, case.keys)] * 2
    q, k, v = (
        torch.randn(*shape, case.head_dim, generator=gen, dtype=dtype).requires_grad_(case.backward)
        for shape in shapes
    )
    positions = torch.arange(case.keys)  # the queries are the last positions
    mask = (positions[None, :] <= positions[-case.queries :, None])[None, None]
    mask = mask.expand(case.batch, 1, -1, -1)
    module = _module(2)
    times: dict[str, list[float]] = {"sdpa": [], "explicit": []}
    for round_index in range(rounds + 1):
        for name, run in (("sdpa", _sdpa), ("explicit", _explicit)):
            start = time.perf_counter()
            out = run(module, q, k, v, mask)
            if case.backward:
                out.sum().backward()
            if round_index:  # round 0 warms up
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}


def table(results: list[dict]) -> str:
    rows = [
        "| case | dtype | [B, H, Tq, Tk] | pass | SDPA ms | explicit ms | SDPA / explicit | "
        "kernels.attention uses |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        case = Case(*r["case"])
        dtype = getattr(torch, r["dtype"])
        explicit = uses_explicit_product(  # the rule, asked of empty tensors of the case's shape
            torch.empty(1, 1, case.queries, 0, dtype=dtype), torch.empty(1, 1, case.keys, 0)
        )
        rows.append(
            f"| {case.name} | {r['dtype']} | [{case.batch}, {case.heads}, {case.queries}, "
            f"{case.keys}] | {'fwd + bwd' if case.backward else 'fwd'} | {r['sdpa']:.2f} "
            f"| {r['explicit']:.2f} | {r['sdpa'] / r['explicit']:.2f}x "
            f"| {'explicit' if explicit else 'SDPA'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for case in CASES:
            ms = time_case(case, dtype, args.rounds)
            results.append({"case": list(case), "dtype": str(dtype).split(".")[1], **ms})
            print(f"{case.name} {dtype}: {ms}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = (
        f"Command: `.venv/bin/python bench/attention.py --write-docs`, {args.threads} threads, "
        f"median of {args.rounds} rounds.\n\n{table(results)}"
    )
    print(text)
    if args.write_docs:
        write_section("attention", text)


if __name__ == "__main__":
    main()
