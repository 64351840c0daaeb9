"""bench/gpu_weight_sync.py: its bucket plan and its model's size (every protocol runs end to
end between two processes in bench/gpu_suite.py --tiny: tests/unit/bench/test_gpu_suite.py)."""

from __future__ import annotations

import math

from tests.unit.bench.bench_modules import load_bench_module

gpu_weight_sync = load_bench_module("gpu_weight_sync")


def test_buckets_keep_model_order_and_a_large_tensor_gets_one_of_its_own() -> None:
    numels = {"a": 3, "b": 4, "c": 10, "d": 2, "e": 2, "f": 5}
    buckets = gpu_weight_sync.plan_buckets(numels, bucket_numel=8)
    assert buckets == [["a", "b"], ["c"], ["d", "e"], ["f"]]


def test_the_7b_shape_has_qwen2_5_7b_s_parameter_count() -> None:
    # The Qwen2.5-7B model card: 7.61B parameters (6.53B without the embeddings).
    tensors = gpu_weight_sync.model_tensors(gpu_weight_sync.SHAPES["7b"])
    total = sum(math.prod(shape) for shape in tensors.values())
    embeddings = 2 * 152064 * 3584  # embed_tokens and the untied lm_head
    assert abs(total / 1e9 - 7.61) < 0.01
    assert abs((total - embeddings) / 1e9 - 6.53) < 0.01
