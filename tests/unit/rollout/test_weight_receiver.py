"""How weight-sync buckets are regrouped into whole vLLM layers (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollout.weight_receiver import WeightAssembler, weight_layers


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(4, 12)
        self.o_proj = nn.Linear(4, 4, bias=False)


class _TinyVLLMModel(nn.Module):
    """The shape of a vLLM causal LM: fused qkv, an embedding tied to the LM head."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, 4)
        self.model.self_attn = _Attention()
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def _assembler() -> WeightAssembler:
    return WeightAssembler(*weight_layers(_TinyVLLMModel()))


def _t(value: float) -> torch.Tensor:
    return torch.full((1,), value)


def test_plan_maps_fused_sources_and_tied_names() -> None:
    layer_of, aliases = weight_layers(_TinyVLLMModel())
    assert layer_of == {
        "model.embed_tokens.weight": "model.embed_tokens",
        "model.self_attn.q_proj.weight": "model.self_attn.qkv_proj",
        "model.self_attn.k_proj.weight": "model.self_attn.qkv_proj",
        "model.self_attn.v_proj.weight": "model.self_attn.qkv_proj",
        "model.self_attn.q_proj.bias": "model.self_attn.qkv_proj",
        "model.self_attn.k_proj.bias": "model.self_attn.qkv_proj",
        "model.self_attn.v_proj.bias": "model.self_attn.qkv_proj",
        "model.self_attn.o_proj.weight": "model.self_attn.o_proj",
        "lm_head.weight": "lm_head",
    }
    tied = ("model.embed_tokens.weight", "lm_head.weight")
    assert aliases == {name: tied for name in tied}


def test_fused_layer_is_released_only_once_complete() -> None:
    assembler = _assembler()
    prefix = "model.self_attn."
    first = [(f"{prefix}q_proj.weight", _t(1)), (f"{prefix}q_proj.bias", _t(2))]
    assert assembler.add(first + [(f"{prefix}o_proj.weight", _t(3))]) == [
        (f"{prefix}o_proj.weight", _t(3))
    ]
    assert assembler.add([(f"{prefix}k_proj.weight", _t(4)), (f"{prefix}k_proj.bias", _t(5))]) == []
    ready = assembler.add([(f"{prefix}v_proj.weight", _t(6)), (f"{prefix}v_proj.bias", _t(7))])
    assert sorted(name for name, _ in ready) == sorted(
        f"{prefix}{proj}.{leaf}"
        for proj in ("q_proj", "k_proj", "v_proj")
        for leaf in ("weight", "bias")
    )
    assert assembler.drain() == []


def test_either_tied_name_loads_both_and_explicit_names_win() -> None:
    assembler = _assembler()
    embed, head = _t(1), _t(2)
    ready = dict(assembler.add([("model.embed_tokens.weight", embed)]))
    assert ready == {"model.embed_tokens.weight": embed, "lm_head.weight": embed}
    ready = dict(assembler.add([("lm_head.weight", head), ("model.embed_tokens.weight", embed)]))
    assert ready["lm_head.weight"] is head and ready["model.embed_tokens.weight"] is embed


def test_unknown_names_wait_for_drain() -> None:
    assembler = _assembler()
    extra = _t(9)
    assert assembler.add([("model.unknown.weight", extra)]) == []
    assert assembler.drain() == [("model.unknown.weight", extra)]
    assert assembler.drain() == []


def test_drain_rejects_a_layer_sent_in_part() -> None:
    assembler = _assembler()
    assembler.add([("model.self_attn.q_proj.weight", _t(1))])
    with pytest.raises(ValueError, match="k_proj.bias"):
        assembler.drain()
    assert assembler.drain() == []


def test_reset_forgets_a_layer_held_back_by_an_interrupted_update() -> None:
    assembler = _assembler()
    assembler.add([("model.self_attn.q_proj.weight", _t(1))])
    assembler.reset()
    assert assembler.drain() == []


def test_held_tensors_are_copied_off_a_reused_buffer() -> None:
    assembler = _assembler()
    buffer = torch.ones(2)
    assembler.add([("model.self_attn.q_proj.weight", buffer[:1])])
    assembler.own_held()
    buffer.fill_(5.0)  # the transport reuses its buffer for a later bucket
    prefix = "model.self_attn."
    rest = [
        (f"{prefix}{p}.{leaf}", _t(0)) for p in ("k_proj", "v_proj") for leaf in ("weight", "bias")
    ]
    ready = dict(assembler.add(rest + [(f"{prefix}q_proj.bias", _t(0))]))
    assert ready[f"{prefix}q_proj.weight"].item() == 1.0


class _FusedExperts(nn.Module):
    """vLLM's fused-MoE layer: every expert's gate/up and down in two 3-D parameters, loaded
    under its `layer_name` (the HF module path of the experts)."""

    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.w13_weight = nn.Parameter(torch.zeros(8, 6, 4))
        self.w2_weight = nn.Parameter(torch.zeros(8, 4, 3))


class _TinyVLLMMoE(nn.Module):
    """The shape of vLLM's Qwen2-MoE block: a router, fused experts (under `routed_experts`),
    and a shared expert with its gate, which the MoE layer reaches by a second path."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(4, 8, bias=False)
        self.mlp.shared_expert_gate = nn.Linear(4, 1, bias=False)
        self.mlp.experts = nn.Module()
        self.mlp.experts.routed_experts = _FusedExperts("mlp.experts")
        self.mlp.experts.shared_gate = self.mlp.shared_expert_gate


def test_fused_experts_load_from_the_trainers_fused_tensors_and_a_second_path_is_one_layer() -> (
    None
):
    layer_of, aliases = weight_layers(_TinyVLLMMoE())
    assert layer_of == {
        "mlp.experts.gate_up_proj": "mlp.experts.routed_experts",
        "mlp.experts.down_proj": "mlp.experts.routed_experts",
        "mlp.gate.weight": "mlp.gate",
        "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate",
    }
    assert aliases == {}  # the shared gate is one module, loaded once
    assembler = WeightAssembler(layer_of, aliases)
    gate_up, down = torch.zeros(8, 6, 4), torch.zeros(8, 4, 3)
    assert assembler.add([("mlp.experts.gate_up_proj", gate_up)]) == []
    ready = assembler.add([("mlp.experts.down_proj", down)])
    assert dict(ready) == {"mlp.experts.gate_up_proj": gate_up, "mlp.experts.down_proj": down}
