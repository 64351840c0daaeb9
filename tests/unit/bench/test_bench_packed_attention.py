"""bench/packed_attention.py: both attentions run the same packed micro-batch, and agree at
the samples' positions."""

from __future__ import annotations

import torch

from kernels.attention import ATTENTION, PACKED_ATTENTION
from tests.unit.bench.bench_modules import load_bench_module
from trainer.packing import packed_input

bench = load_bench_module("packed_attention")


def test_the_masked_and_the_packed_attention_time_one_step_each_and_agree() -> None:
    batch = bench.batch(5, 40)
    assert batch.num_sequences == bench.NUM_SAMPLES and batch.attention_mask.shape[1] == 40
    inputs = packed_input(batch)
    assert inputs.input_ids.shape[0] < bench.NUM_SAMPLES  # rows hold several samples
    model = bench.decoder(torch.float32)
    (masked_s, masked), (packed_s, packed) = (
        bench.step(model, inputs, implementation)
        for implementation in (ATTENTION, PACKED_ATTENTION)
    )
    assert masked_s > 0 and packed_s > 0
    torch.testing.assert_close(packed[inputs.real], masked[inputs.real], atol=1e-4, rtol=1e-4)
