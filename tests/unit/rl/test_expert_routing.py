"""Router hooks on a mixture of experts (rl.expert_routing), checked against the HF model's own
router run by hand on the same hidden states, and against HF forwards whose router is patched
in the test to return recorded experts."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rl.expert_routing import NATURAL, ExpertRouting, moe_routers

SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=128,
)


def tiny_moe(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=32, norm_topk_prob=True, **SIZES))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=64, **SIZES))
    # HF initialises routers to zero (every expert ties); random routers make choices distinct.
    for router in moe_routers(model):
        torch.nn.init.normal_(router.weight, std=0.5)
    return model.eval()


def own_routing(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The router's top-k experts of `hidden` [N, d], computed here from its weight."""
    probs = torch.softmax(hidden.double() @ router.weight.double().T, dim=-1)
    return probs.topk(router.top_k, dim=-1).indices


def random_record(num_tokens: int, layers: int, k: int, experts: int) -> torch.Tensor:
    """Distinct expert ids per (token, layer), drawn independently of any model."""
    generator = torch.Generator().manual_seed(1)
    draws = torch.rand(num_tokens, layers, experts, generator=generator)
    return draws.argsort(dim=-1)[..., :k]


def patched_forward(model: torch.nn.Module, record: torch.Tensor, ids: torch.Tensor):
    """An HF forward whose routers return `record`'s experts (gates: softmax probabilities at
    them, renormalised as the router renormalises), written here without the hooks."""
    routers = moe_routers(model)
    originals = []
    for layer, router in enumerate(routers):

        def forward(hidden, router=router, layer=layer):
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(hidden, router.weight)
            chosen = record[:, layer]
            gates = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if router.norm_topk_prob:
                gates = gates / gates.sum(dim=-1, keepdim=True)
            return logits, gates.to(logits.dtype), chosen

        originals.append(router.forward)
        router.forward = forward
    try:
        return model(input_ids=ids).logits
    finally:
        for router, original in zip(routers, originals, strict=True):
            router.forward = original


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_recorded_experts_are_the_routers_top_k_of_its_inputs(arch: str) -> None:
    model = tiny_moe(arch)
    inputs: list[torch.Tensor] = []
    for router in moe_routers(model):
        router.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach()))
    routing = ExpertRouting(model)
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids)
    recorded = routing.recorded()
    assert recorded.shape == (33, 2, 2)
    for layer, router in enumerate(moe_routers(model)):
        expected = own_routing(router, inputs[layer].reshape(-1, 64))
        assert torch.equal(recorded[:, layer].sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_replayed_forward_equals_a_forward_whose_router_returns_the_record(arch: str) -> None:
    model = tiny_moe(arch)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    record = random_record(18, 2, 2, 8)
    with torch.no_grad():
        expected = patched_forward(model, record, ids)
        free = model(input_ids=ids).logits
        routing = ExpertRouting(model)
        with routing.replaying(record):
            replayed = model(input_ids=ids).logits
    torch.testing.assert_close(replayed, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(free, expected, atol=1e-3), "the record must change the routing"
    assert torch.equal(routing.recorded(), record)


def test_natural_rows_route_as_the_router_chooses() -> None:
    model = tiny_moe("qwen3_moe")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        free = model(input_ids=ids).logits
        routing = ExpertRouting(model)
        natural = torch.full((14, 2, 2), NATURAL)
        with routing.replaying(natural):
            replayed = model(input_ids=ids).logits
        # Forcing some rows to the experts they choose anyway changes nothing either.
        chosen = routing.recorded()
        mixed = torch.where(torch.arange(14)[:, None, None] % 2 == 0, chosen, NATURAL)
        with routing.replaying(mixed):
            half = model(input_ids=ids).logits
    assert torch.equal(replayed, free)
    assert torch.equal(half, free)


def test_router_learns_under_replay_as_under_the_patched_router() -> None:
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    record = random_record(18, 2, 2, 8)
    patched = tiny_moe("qwen3_moe").train()
    patched_forward(patched, record, ids).logsumexp(-1).sum().backward()
    hooked = tiny_moe("qwen3_moe").train()
    routing = ExpertRouting(hooked)
    with routing.replaying(record):
        hooked(input_ids=ids).logits.logsumexp(-1).sum().backward()
    for a, b in zip(moe_routers(patched), moe_routers(hooked), strict=True):
        assert b.weight.grad is not None and b.weight.grad.abs().sum() > 0
        torch.testing.assert_close(b.weight.grad, a.weight.grad, rtol=1e-5, atol=1e-7)


def test_a_dense_model_has_no_routers() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in SIZES.items() if "expert" not in k})
    assert moe_routers(Qwen2ForCausalLM(config)) == []
