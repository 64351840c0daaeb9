"""Packed rows' attention: `kernels.attention.packed_attention` (each sample attends within
itself, no mask) against the [width, width] mask transformers builds from the packed rows'
positions, in a decoder's forward and backward on CPU.

    .venv/bin/python bench/packed_attention.py [--rounds 7] [--threads 2]

A random model of the demo's shape (recipes/grpo_addition_cpu.yaml's `base`: Qwen2, 2 layers,
hidden 128, 4 heads, 2 key/value heads, MLP 1024) runs one micro-batch of 128 samples packed
as `trainer.packing.packed_input` packs them, the decoder's forward and the backward of a sum
of its outputs, for each case below, in fp32 and bf16; the two attentions take turns, and
each time is the median of `--rounds`. The outputs at the samples' positions agree (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM

from kernels.attention import ATTENTION, PACKED_ATTENTION
from rl.types import Batch
from trainer.packing import packed_input

DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_addition_cpu.yaml"

# name -> (shortest, longest) sample of the 128
CASES = {
    "demo-like: 15-25 tokens, one sample a row": (15, 25),
    "mixed: 5-200 tokens, several samples a row": (5, 200),
    "long: 64-1024 tokens, several samples a row": (64, 1024),
}
NUM_SAMPLES = 128


def decoder(dtype: torch.dtype) -> torch.nn.Module:
    base = yaml.safe_load(DEMO_RECIPE.read_text())["base"]
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=base["hidden_size"],
        num_hidden_layers=base["num_layers"],
        num_attention_heads=base["num_heads"],
        num_key_value_heads=base["num_kv_heads"],
        intermediate_size=base["intermediate_size"],
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype).get_decoder()


def batch(shortest: int, longest: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (NUM_SAMPLES,), generator=gen)
    lengths[0] = longest
    mask = (torch.arange(longest) < lengths[:, None]).long()
    ids = torch.randint(1, 320, (NUM_SAMPLES, longest), generator=gen) * mask
    loss_mask = mask[:, 1:].float()
    return Batch(ids, mask, loss_mask, loss_mask, loss_mask, loss_mask)


def step(model: torch.nn.Module, inputs, implementation: str) -> tuple[float, torch.Tensor]:
    """Seconds of one forward and backward, and the outputs."""
    model.config._attn_implementation = implementation
    segments = {"segments": inputs.segments} if implementation == PACKED_ATTENTION else {}
    for param in model.parameters():
        param.grad = None
    start = time.perf_counter()
    hidden = model(
        input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **segments
    ).last_hidden_state
    hidden.float().sum().backward()
    return time.perf_counter() - start, hidden.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| case | dtype | rows x width | masked ms | packed_attention ms | packed / masked |")
    print("|---|---|---|---:|---:|---:|")
    for name, (shortest, longest) in CASES.items():
        inputs = packed_input(batch(shortest, longest))
        real = inputs.real
        for dtype in (torch.float32, torch.bfloat16):
            model = decoder(dtype)
            times = {ATTENTION: [], PACKED_ATTENTION: []}
            outputs = {}
            for round_ in range(args.rounds + 1):
                for implementation in times:
                    seconds, outputs[implementation] = step(model, inputs, implementation)
                    if round_:  # the first round warms up
                        times[implementation].append(seconds)
            masked, packed = (outputs[i][real].float() for i in (ATTENTION, PACKED_ATTENTION))
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(packed, masked, atol=tolerance, rtol=tolerance)
            masked_ms, packed_ms = (1e3 * statistics.median(times[i]) for i in times)
            rows, width = inputs.input_ids.shape
            print(
                f"| {name} | {str(dtype).removeprefix('torch.')} | {rows} x {width} "
                f"| {masked_ms:.1f} | {packed_ms:.1f} | {packed_ms / masked_ms:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
