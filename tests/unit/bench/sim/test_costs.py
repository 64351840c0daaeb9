"""bench/sim/costs.py against published measurements: vLLM's decode speed on H100 (the two
figures its decode overheads were fitted to, and Qwen's own A100 figures, which they were
not), and the memory and FLOP formulas written out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.bench.bench_modules import bench_import

costs = bench_import("sim.costs")

# Llama-3-8B's config.json: 8.03e9 parameters, 32 layers, hidden 4096, 8 KV heads of 128.
LLAMA3_8B = costs.Model("Llama-3-8B", 8.03e9, 32, 4096, 8, 128, tp=1)
# ShareGPT as vLLM's benchmarks sample it: 202 prompt and 179 response tokens on average.
SHAREGPT_IN, SHAREGPT_OUT = 202, 179


def test_decode_reproduces_the_vllm_h100_figures_it_was_fitted_to() -> None:
    cost = costs.CostModel(costs.H100, LLAMA3_8B)
    context = SHAREGPT_IN + SHAREGPT_OUT / 2  # a running sample's mean context
    # LambdaLabsML/vllm-benchmark: 10 concurrent requests, median time per token 7.56 ms.
    assert cost.decode_step_s(10, 10 * context) == pytest.approx(7.56e-3, rel=0.02)
    # The same benchmark, 256 sequences at once: 8,088 output tokens/s, prefills included.
    requests_per_s = 8088 / SHAREGPT_OUT
    prefill_share = requests_per_s * cost.prefill_s(SHAREGPT_IN, 0)
    tokens_per_s = 256 / cost.decode_step_s(256, 256 * context) * (1 - prefill_share)
    assert tokens_per_s == pytest.approx(8088, rel=0.02)


def test_decode_is_within_a_quarter_of_qwens_own_a100_figures_it_was_not_fitted_to() -> None:
    # Qwen2.5's speed benchmark, vLLM 0.6.3, one A100 80GB (2.039 TB/s, 312 TFLOPS),
    # batch 1, 2,048 new tokens: 84.28 tokens/s after a 1-token prompt, 70.33 after 30,720.
    a100 = costs.Gpu("A100", 80e9, 2.039e12, 312e12, 300e9, 25e9, 25e9)
    cost = costs.CostModel(a100, costs.QWEN25_7B)
    for prompt, measured in ((1, 84.28), (30_720, 70.33)):
        predicted = 1 / cost.decode_step_s(1, prompt + 1024)
        assert predicted == pytest.approx(measured, rel=0.25)


def test_the_kv_cache_holds_what_vllms_memory_share_leaves_after_the_weights() -> None:
    cost = costs.CostModel(costs.H100, costs.QWEN25_7B)
    per_token = 2 * 28 * 4 * 128 * 2  # keys and values, 28 layers, 4 KV heads of 128, bf16
    assert cost.kv_capacity_tokens() == int((0.9 * 80e9 - 2 * 7.62e9) // per_token)
    # Beside a trainer sharded over 8 GPUs: its 16 bytes a parameter, and its activations.
    beside = 0.9 * 80e9 - 2 * 7.62e9 - (16 * 7.62e9 / 8 + 8 * 2**30)
    assert cost.kv_capacity_tokens(trainer_gpus_sharing=8) == int(beside // per_token)


def test_a_model_that_does_not_fit_beside_its_trainer_is_refused() -> None:
    cost = costs.CostModel(costs.H100, costs.QWEN25_32B)
    with pytest.raises(
        ValueError, match="Qwen2.5-32B does not fit on 2 H100 GPUs beside its trainer"
    ):
        cost.kv_capacity_tokens(trainer_gpus_sharing=8)


def test_training_costs_six_flops_a_parameter_a_token_plus_causal_attention() -> None:
    cost = costs.CostModel(costs.H100, costs.QWEN25_7B)
    s = 4096
    flops = 6 * 7.62e9 * s + 6 * 28 * 3584 * s * s
    assert cost.train_s([s, s], gpus=8) == pytest.approx(2 * flops / (8 * 989e12 * 0.35))
    assert cost.annotate_s([s], gpus=8) == pytest.approx(flops / 3 / (8 * 989e12 * 0.35))


def test_a_sync_moves_each_engine_gpus_share_of_the_bf16_weights_over_its_link() -> None:
    cost = costs.CostModel(costs.H200, costs.QWEN25_32B)  # TP 2: half the weights a GPU
    assert cost.sync_s(colocated_on_one_node=True) == pytest.approx(2 * 32.8e9 / 2 / 450e9 + 0.1)
    assert cost.sync_s(colocated_on_one_node=False) == pytest.approx(2 * 32.8e9 / 2 / 50e9 + 0.1)


def _moe_and_its_dense_twins() -> tuple:
    """A mixture of experts of Qwen3-30B-A3B's size (30.5B parameters, 3.35B a token), a dense
    model of its active size and one of its total size, their shapes otherwise the same."""
    moe = costs.Model("MoE", 30.5e9, 48, 2048, 4, 128, tp=1, active_params=3.35e9)
    active = dataclasses.replace(moe, name="dense-active", params=3.35e9, active_params=None)
    total = dataclasses.replace(moe, name="dense-total", active_params=None)
    return moe, active, total


def test_a_mixture_of_experts_computes_with_its_active_and_moves_its_total_parameters() -> None:
    moe, active, total = (costs.CostModel(costs.H200, m) for m in _moe_and_its_dense_twins())
    s = 4096
    # Compute: 6 (training) or 2 (a forward) FLOPs an active parameter, as the dense twin.
    flops = 6 * 3.35e9 * s + 6 * 48 * 2048 * s * s
    assert moe.train_s([s], gpus=8) == pytest.approx(flops / (8 * 989e12 * 0.35))
    assert moe.train_s([s], gpus=8) == active.train_s([s], gpus=8)
    assert moe.annotate_s([s], gpus=8) == active.annotate_s([s], gpus=8)
    assert moe.prefill_s(s, 512) == active.prefill_s(s, 512)
    # Bytes: every expert's bf16 weights, as the dense model of the total size.
    assert moe.sync_s(colocated_on_one_node=False) == pytest.approx(2 * 30.5e9 / 50e9 + 0.1)
    assert moe.sync_s(colocated_on_one_node=True) == total.sync_s(colocated_on_one_node=True)
    assert moe.engine_sleep_s() == total.engine_sleep_s()
    assert moe.trainer_offload_s(8) == total.trainer_offload_s(8)
    assert moe.kv_capacity_tokens() == total.kv_capacity_tokens()
    # A decode step reads every expert's weights, or multiplies with the active ones.
    batch, context = 256, 256 * 1000
    kv = 2 * 48 * 4 * 128 * 2
    memory = (2 * 30.5e9 + kv * context) / (4.8e12 * 0.8)
    compute = 2 * 3.35e9 * batch / (989e12 * 0.5)
    assert moe.decode_step_s(batch, context) == pytest.approx(
        0.001 + 4.5e-5 * batch + max(memory, compute)
    )


# Ulysses sequence parallelism, Qwen2.5-7B: 28 layers, hidden 3584 = 28 query heads of 128,
# 4 key/value heads, MLP 18944. Degrees 4 and 7 stay on one 8-GPU node, 14 spans two.


def test_a_ranks_all_to_all_bytes_are_its_positions_q_k_v_and_output_less_its_own_share() -> None:
    positions = 1000
    for n, kv_heads in ((4, 4), (7, 28)):  # k and v repeated to lcm(4, n) heads
        cost = costs.CostModel(costs.H100, costs.QWEN25_7B, sequence_parallel=n)
        forward = 28 * positions * (2 * 28 + 2 * kv_heads) * 128 * 2 * (n - 1) / n
        assert cost.all_to_all_bytes(positions) == pytest.approx(2 * forward)  # and backward
    assert costs.CostModel(costs.H100, costs.QWEN25_7B).all_to_all_bytes(positions) == 0
    with pytest.raises(ValueError, match="sequence_parallel=3 does not divide .* 28"):
        costs.CostModel(costs.H100, costs.QWEN25_7B, sequence_parallel=3)


def test_sequence_parallel_training_adds_the_all_to_alls_over_nvlink_or_the_network() -> None:
    s, gpus = 32768, 56
    flops = 6 * 7.62e9 * s + 6 * 28 * 3584 * s * s
    compute = 2 * flops / (gpus * 989e12 * 0.35)
    per_rank = 2 * s / gpus  # each rank's share of the two samples' positions
    for n, kv_heads, link in ((7, 28, 450e9), (14, 28, 50e9)):
        cost = costs.CostModel(costs.H100, costs.QWEN25_7B, sequence_parallel=n)
        sent = 2 * 28 * per_rank * (2 * 28 + 2 * kv_heads) * 128 * 2 * (n - 1) / n
        assert cost.train_s([s, s], gpus) == pytest.approx(compute + sent / link)
        forward = flops / 3 * 2 / (gpus * 989e12 * 0.35)
        assert cost.annotate_s([s, s], gpus) == pytest.approx(forward + sent / 2 / link)


def test_a_trainer_ranks_memory_for_a_long_sample_shrinks_with_the_degree():
    s, gpus = 131072, 64
    state = 16 * 7.62e9 / 64
    one = costs.CostModel(costs.H100, costs.QWEN25_7B).trainer_rank_bytes(s, gpus)
    layer = 5 * 3584 + 2 * 4 * 128 + 4 * 18944
    assert one == pytest.approx(state + 2 * s * (28 * 3584 + layer))
    seven = costs.CostModel(costs.H100, costs.QWEN25_7B, sequence_parallel=7)
    width = 131075  # padded to a multiple of 7
    layer = 5 * 3584 + 2 * 28 * 128 + 4 * 18944
    activations = 2 * (width // 7) * (28 * 3584 + layer)
    exchange = 2 * (width // 7) * (28 * 128 + 2 * 28 * 128) * 2
    assert seven.trainer_rank_bytes(s, gpus) == pytest.approx(state + activations + exchange)
    # No term grows with the square of the length: 7 ranks hold about a seventh.
    assert seven.trainer_rank_bytes(s, gpus) - state < (one - state) / 6
