"""The weight-sync transfer plan: FSDP2 rows, vLLM tensor-parallel regions, buckets."""

from __future__ import annotations

import pytest
import torch

from rl.sync.plan import (
    AttentionShape,
    Region,
    TensorSpec,
    load_unit,
    needed_region,
    owned_rows,
    plan_from_json,
    plan_to_json,
    plan_weight_sync,
)

# Qwen2.5-0.5B's attention: 14 query heads, 2 kv heads of 64; vocabulary 151,936.
SHAPE = AttentionShape(num_heads=14, num_kv_heads=2, head_dim=64, vocab_size=151_936)


def _layer(prefix: str, hidden: int = 896, inter: int = 4864) -> list[TensorSpec]:
    kv = SHAPE.num_kv_heads * SHAPE.head_dim
    return [
        TensorSpec(f"{prefix}.self_attn.q_proj.weight", (hidden, hidden)),
        TensorSpec(f"{prefix}.self_attn.q_proj.bias", (hidden,)),
        TensorSpec(f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
        TensorSpec(f"{prefix}.self_attn.k_proj.bias", (kv,)),
        TensorSpec(f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
        TensorSpec(f"{prefix}.self_attn.v_proj.bias", (kv,)),
        TensorSpec(f"{prefix}.self_attn.o_proj.weight", (hidden, hidden)),
        TensorSpec(f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
        TensorSpec(f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
        TensorSpec(f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
        TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,)),
    ]


def _model(num_layers: int = 2) -> list[TensorSpec]:
    specs = [TensorSpec("model.embed_tokens.weight", (SHAPE.vocab_size, 896))]
    for i in range(num_layers):
        specs += _layer(f"model.layers.{i}")
    return specs + [TensorSpec("model.norm.weight", (896,))]


@pytest.mark.parametrize("num_rows", [1, 2, 5, 64, 151_936])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_owned_rows_match_torch_chunk(num_rows: int, world_size: int) -> None:
    chunks = torch.arange(num_rows).chunk(world_size)
    for rank in range(world_size):
        start, stop = owned_rows(num_rows, rank, world_size)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected


def test_column_parallel_splits_rows_and_row_parallel_splits_columns() -> None:
    q = TensorSpec("model.layers.0.self_attn.q_proj.weight", (896, 896))
    o = TensorSpec("model.layers.0.self_attn.o_proj.weight", (896, 896))
    down = TensorSpec("model.layers.0.mlp.down_proj.weight", (896, 4864))
    assert needed_region(q, SHAPE, 1, 2) == Region(448, 896, 0, 896)
    assert needed_region(o, SHAPE, 1, 2) == Region(0, 896, 448, 896)
    assert needed_region(down, SHAPE, 0, 2) == Region(0, 896, 0, 2432)
    bias = TensorSpec("model.layers.0.self_attn.o_proj.bias", (896,))
    assert needed_region(bias, SHAPE, 1, 2) == Region(0, 896, 0, 1)  # row-parallel: replicated


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    k = TensorSpec("model.layers.0.self_attn.k_proj.weight", (128, 896))
    # TP 2 = 2 kv heads: one each; TP 4: each head shared by two ranks.
    assert [needed_region(k, SHAPE, t, 2).row_start for t in range(2)] == [0, 64]
    assert [needed_region(k, SHAPE, t, 4).row_start for t in range(4)] == [0, 0, 64, 64]
    assert all(needed_region(k, SHAPE, t, 4).row_stop - 64 in (0, 64) for t in range(4))


def test_vocab_split_follows_the_padded_vocabulary() -> None:
    shape = AttentionShape(num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=100)
    embed = TensorSpec("model.embed_tokens.weight", (100, 64))
    # 100 pads to 128: rank 0 takes rows 0..63, rank 1 the 36 real rows left.
    assert needed_region(embed, shape, 0, 2) == Region(0, 64, 0, 64)
    assert needed_region(embed, shape, 1, 2) == Region(64, 100, 0, 64)
    head = TensorSpec("lm_head.weight", (100, 64))
    assert needed_region(head, shape, 1, 2) == Region(64, 100, 0, 64)


def test_uneven_split_is_a_clear_error() -> None:
    gate = TensorSpec("model.layers.0.mlp.gate_proj.weight", (4864, 896))
    with pytest.raises(ValueError, match="gate_proj.*3 TP ranks"):
        needed_region(gate, SHAPE, 0, 3)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_element_is_loaded_by_some_rank_and_tp1_takes_everything_whole(
    tp_size: int,
) -> None:
    for spec in _model(1):
        covered = torch.zeros(spec.num_rows, spec.num_cols, dtype=torch.bool)
        for t in range(tp_size):
            r = needed_region(spec, SHAPE, t, tp_size)
            covered[r.row_start : r.row_stop, r.col_start : r.col_stop] = True
            if tp_size == 1:
                assert r == Region(0, spec.num_rows, 0, spec.num_cols)
        assert covered.all(), spec.name


def test_load_units_fuse_qkv_and_gate_up() -> None:
    assert load_unit("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert load_unit("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert load_unit("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"
    assert load_unit("lm_head.weight") == "lm_head"


@pytest.mark.parametrize(("wire", "element"), [("float32", 4), ("bfloat16", 2)])
def test_buckets_hold_whole_units_within_the_budget_in_the_wire_dtype(
    wire: str, element: int
) -> None:
    specs = _model(2)
    bucket_bytes = 20 << 20
    plan = plan_weight_sync(
        specs, SHAPE, world_size=2, tp_size=2, bucket_bytes=bucket_bytes, wire_dtype=wire
    )
    assert [s for bucket in plan.buckets for s in bucket] == specs  # each once, in order
    units_seen: set[str] = set()
    for bucket in plan.buckets:
        units = {load_unit(s.name) for s in bucket}
        assert not units & units_seen  # a unit never spans buckets
        units_seen |= units
        size = element * sum(s.num_rows * s.num_cols for s in bucket)
        assert size <= bucket_bytes or len(units) == 1  # only a lone unit may exceed it
    numel = sum(s.num_rows * s.num_cols for s in specs)
    assert plan.total_bytes == element * numel and plan.bytes_per_element == element
    # The 545 MB embedding travels alone, so a slot holds it whole.
    assert plan.buckets[0] == (specs[0],)
    assert plan.slot_numel == SHAPE.vocab_size * 896


def test_offsets_lay_a_bucket_out_whole_and_the_slot_fits_the_largest() -> None:
    plan = plan_weight_sync(
        _model(1), SHAPE, world_size=3, tp_size=2, bucket_bytes=8 << 20, wire_dtype="float32"
    )
    for bucket, specs in enumerate(plan.buckets):
        sizes = [s.num_rows * s.num_cols for s in specs]
        assert plan.offsets(bucket) == [sum(sizes[:i]) for i in range(len(sizes))]
        assert sum(sizes) <= plan.slot_numel
    assert plan.slot_numel == max(sum(s.num_rows * s.num_cols for s in b) for b in plan.buckets)


def test_everything_frozen_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="every parameter is frozen"):
        plan_weight_sync(
            [], SHAPE, world_size=2, tp_size=1, bucket_bytes=1 << 20, wire_dtype="float32"
        )


def test_slicing_halves_the_bytes_per_rank_at_tp2() -> None:
    plan = plan_weight_sync(
        _model(2), SHAPE, world_size=2, tp_size=2, bucket_bytes=64 << 20, wire_dtype="float32"
    )
    whole = plan_weight_sync(
        _model(2), SHAPE, world_size=2, tp_size=1, bucket_bytes=64 << 20, wire_dtype="float32"
    )
    assert whole.bytes_to_rank(0) == whole.total_bytes == plan.total_bytes
    # Everything but norms, biases of row-parallel layers and replicated kv is split in two.
    assert 0.5 < plan.bytes_to_rank(0) / plan.total_bytes < 0.51


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_plan_survives_json(wire: str) -> None:
    plan = plan_weight_sync(
        _model(1), SHAPE, world_size=2, tp_size=2, bucket_bytes=8 << 20, wire_dtype=wire
    )
    assert plan_from_json(plan_to_json(plan)) == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"world_size": 0}, "world_size=0"), ({"bucket_bytes": 0}, "bucket_bytes=0")],
)
def test_plan_rejects_bad_sizes(kwargs: dict, message: str) -> None:
    args = {"world_size": 2, "tp_size": 1, "bucket_bytes": 1 << 20, "wire_dtype": "float32"}
    args |= kwargs
    with pytest.raises(ValueError, match=message):
        plan_weight_sync(_model(1), SHAPE, **args)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_lora_plan_sends_each_adapter_whole_to_every_tp_rank_and_nothing_else(
    tp_size: int,
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.weight_sender import trained_tensors

    hidden, inter, kv, rank = 64, 96, 32, 4
    config = Qwen2Config(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        LoraConfig(r=rank, target_modules=["q_proj", "k_proj", "down_proj"]),
    )
    specs = trained_tensors(model)
    assert {s.name.rsplit(".", 3)[-3] for s in specs} == {"lora_A", "lora_B"}
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
    plan = plan_weight_sync(
        specs, shape, world_size=2, tp_size=tp_size, bucket_bytes=1 << 20, wire_dtype="float32"
    )
    # vLLM's LoRA layers slice an adapter for their TP rank themselves: each rank gets it whole.
    for spec in specs:
        for tp_rank in range(tp_size):
            assert plan.region(spec, tp_rank) == Region(0, spec.num_rows, 0, spec.num_cols)
    # A [r, in] and B [out, r] of q (64 -> 64), k (64 -> 32) and down (96 -> 64), per layer.
    adapters = 2 * rank * ((hidden + hidden) + (hidden + kv) + (inter + hidden))
    assert plan.total_bytes == 4 * adapters
    assert all(plan.bytes_to_rank(r) == 4 * adapters for r in range(tp_size))


def test_fused_experts_and_the_router_are_needed_whole_and_travel_together() -> None:
    """A mixture of experts at TP 2: vLLM's rank keeps a slice of every expert's intermediate
    dimension (no one block of the [E, 2I*H] / [E, H*I] views), so the fused expert tensors go
    whole, as does the replicated router; the shared expert splits like a dense MLP. A
    layer's two expert tensors load into one vLLM layer: one load unit, one bucket."""
    experts, hidden, inter = 8, 896, 256
    gate_up = TensorSpec("model.layers.0.mlp.experts.gate_up_proj", (experts, 2 * inter, hidden))
    down = TensorSpec("model.layers.0.mlp.experts.down_proj", (experts, hidden, inter))
    router = TensorSpec("model.layers.0.mlp.gate.weight", (experts, hidden))
    shared = TensorSpec("model.layers.0.mlp.shared_expert.gate_proj.weight", (inter, hidden))
    for spec in (gate_up, down, router):
        for tp_rank in range(2):
            assert needed_region(spec, SHAPE, tp_rank, 2) == Region(
                0, spec.num_rows, 0, spec.num_cols
            )
    assert needed_region(shared, SHAPE, 1, 2) == Region(inter // 2, inter, 0, hidden)
    assert load_unit(gate_up.name) == load_unit(down.name) == "model.layers.0.mlp.experts"
    plan = plan_weight_sync(
        [router, gate_up, down],
        SHAPE,
        world_size=2,
        tp_size=2,
        bucket_bytes=1,
        wire_dtype="float32",
    )
    assert plan.buckets == ((router,), (gate_up, down))
