"""rl.algorithms.router_losses: the MoE router losses against transformers' own balance loss,
per-token loops and their analytic gradients; the expert-load statistics against counts worked
out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rl.algorithms.router_losses import (
    ROUTER_LOSSES,
    balance_loss,
    moe_metrics,
    router_loss,
    router_tally,
    z_loss,
)
from rl.config import AlgorithmConfig

E, K = 8, 2


def _routing(
    tokens: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random router logits [tokens, E] and their natural top-K experts."""
    logits = torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed)) * 2.0
    logits = logits.to(dtype)
    return logits, logits.float().topk(K, dim=-1).indices


def _mask(tokens: int, padded: list[int]) -> torch.Tensor:
    mask = torch.ones(tokens)
    mask[padded] = 0.0
    return mask


def _balance_loop(logits: torch.Tensor, topk: torch.Tensor, mask: torch.Tensor) -> float:
    """E * sum_e f_e P_e with f_e the share of the kept tokens' (token, slot) assignments that
    chose e and P_e their mean softmax probability of e, in Python floats."""
    kept = [n for n in range(logits.shape[0]) if mask[n] > 0]
    assigned = [0] * E
    mean_prob = [0.0] * E
    for n in kept:
        for expert in topk[n].tolist():
            assigned[expert] += 1
        row = [math.exp(v) for v in logits[n].double().tolist()]
        for e in range(E):
            mean_prob[e] += row[e] / sum(row) / len(kept)
    return E * sum(assigned[e] / sum(assigned) * mean_prob[e] for e in range(E))


def _z_loop(logits: torch.Tensor, mask: torch.Tensor) -> float:
    kept = [n for n in range(logits.shape[0]) if mask[n] > 0]
    lse = [math.log(sum(math.exp(v) for v in logits[n].double().tolist())) for n in kept]
    return sum(v * v for v in lse) / len(kept)


# ---------------------------------------------------------------- losses


def test_balance_loss_is_transformers_qwen3_moe_loss_over_k_on_one_layer() -> None:
    # transformers divides the assignment counts by tokens (they sum to k), we by assignments
    # (they sum to 1); both drop the attention mask's padding from counts and probabilities.
    batch, seq = 3, 7
    logits, topk = _routing(batch * seq, seed=0)
    attention = torch.ones(batch, seq)
    attention[0, 5:] = 0.0
    attention[2, 2:] = 0.0
    theirs = load_balancing_loss_func((logits,), E, K, attention)
    ours = balance_loss(logits, topk, attention.reshape(-1))
    assert ours.item() * K == pytest.approx(theirs.item(), rel=1e-5)


def test_balance_loss_matches_a_per_token_loop_and_ignores_masked_rows() -> None:
    logits, topk = _routing(12, seed=1)
    mask = _mask(12, [3, 10])
    expected = _balance_loop(logits, topk, mask)
    assert balance_loss(logits, topk, mask).item() == pytest.approx(expected, rel=1e-5)
    # Masked rows' logits and experts reach nothing.
    logits[mask == 0] = 1e4
    topk[mask == 0] = 0
    assert balance_loss(logits, topk, mask).item() == pytest.approx(expected, rel=1e-5)


def test_balance_loss_takes_the_given_experts_not_the_natural_top_k() -> None:
    # Under routing replay the experts are the engine's: all on experts 0 and 1 here.
    logits, _ = _routing(6, seed=2)
    replayed = torch.tensor([[0, 1]] * 6, dtype=torch.int16)
    mask = torch.ones(6)
    expected = _balance_loop(logits, replayed.long(), mask)
    assert balance_loss(logits, replayed, mask).item() == pytest.approx(expected, rel=1e-5)


def test_balance_loss_is_one_under_a_uniform_router_whatever_the_routing() -> None:
    # P_e = 1/E for every e, so E sum_e f_e / E = sum_e f_e = 1.
    topk = torch.tensor([[0, 1], [0, 1], [0, 2], [5, 0]])
    assert balance_loss(torch.zeros(4, E), topk, torch.ones(4)).item() == pytest.approx(1.0)


def test_z_loss_matches_a_per_token_loop_and_ignores_masked_rows() -> None:
    logits, topk = _routing(9, seed=3)
    mask = _mask(9, [0, 4])
    expected = _z_loop(logits, mask)
    assert z_loss(logits, topk, mask).item() == pytest.approx(expected, rel=1e-5)
    logits[mask == 0] = 1e4
    assert z_loss(logits, topk, mask).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", ["balance", "z"])
def test_router_losses_of_bf16_logits_are_computed_in_fp32(name: str) -> None:
    logits, topk = _routing(10, seed=4, dtype=torch.bfloat16)
    mask = torch.ones(10)
    loss = ROUTER_LOSSES.get(name)
    got = loss(logits, topk, mask)
    assert got.dtype == torch.float32
    # The same bf16 values upcast first give the same fp32 result.
    assert got.item() == loss(logits.float(), topk, mask).item()


@pytest.mark.parametrize("name", ["balance", "z"])
def test_router_losses_are_0_on_an_empty_mask(name: str) -> None:
    logits, topk = _routing(4, seed=5)
    assert ROUTER_LOSSES.get(name)(logits, topk, torch.zeros(4)).item() == 0.0


def test_balance_loss_gradient_is_the_analytic_one() -> None:
    # f fixed by the routing: dL/dx_nj = E / N * p_nj (f_j - sum_e f_e p_ne) on kept rows.
    logits, topk = _routing(10, seed=6)
    mask = _mask(10, [2, 7])
    logits.requires_grad_()
    balance_loss(logits, topk, mask).backward()
    probs = torch.softmax(logits.detach().double(), dim=-1)
    share = torch.bincount(topk[mask > 0].reshape(-1), minlength=E).double()
    share /= share.sum()
    expected = E / mask.sum() * probs * (share - (probs * share).sum(1, keepdim=True))
    expected = expected * mask.double().unsqueeze(1)
    assert torch.allclose(logits.grad.double(), expected, atol=1e-6)


def test_z_loss_gradient_is_the_analytic_one() -> None:
    # dL/dx_nj = 2 lse_n softmax(x_n)_j / N on kept rows.
    logits, topk = _routing(10, seed=7)
    mask = _mask(10, [0])
    logits.requires_grad_()
    z_loss(logits, topk, mask).backward()
    x = logits.detach().double()
    expected = 2 * torch.logsumexp(x, -1, keepdim=True) * torch.softmax(x, -1) / mask.sum()
    expected = expected * mask.double().unsqueeze(1)
    assert torch.allclose(logits.grad.double(), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["balance", "z"])
def test_router_loss_gradients_pass_a_finite_difference_check(name: str) -> None:
    logits, topk = _routing(6, seed=8, dtype=torch.float64)
    mask = _mask(6, [5])
    loss = ROUTER_LOSSES.get(name)
    assert gradcheck(lambda x: loss(x, topk, mask), (logits.requires_grad_(),))


def test_router_loss_weights_each_loss_by_its_coefficient_and_averages_layers() -> None:
    layers = [_routing(8, seed=s) for s in (9, 10, 11)]
    mask = _mask(8, [6])
    logits, topk = [x for x, _ in layers], [ids for _, ids in layers]
    cfg = AlgorithmConfig(router_balance_coef=0.01, router_z_coef=0.001)
    balance = sum(_balance_loop(x, ids, mask) for x, ids in layers) / 3
    z = sum(_z_loop(x, mask) for x in logits) / 3
    got = router_loss(logits, topk, mask, cfg)
    assert got.item() == pytest.approx(0.01 * balance + 0.001 * z, rel=1e-5)
    only_z = router_loss(logits, topk, mask, AlgorithmConfig(router_z_coef=0.001))
    assert only_z.item() == pytest.approx(0.001 * z, rel=1e-5)


def test_each_router_loss_names_an_algorithm_coefficient_that_defaults_to_off() -> None:
    cfg = AlgorithmConfig()
    for name in ROUTER_LOSSES.names():
        assert getattr(cfg, ROUTER_LOSSES.traits(name).coef) == 0.0


# ---------------------------------------------------------------- load statistics

# 5 kept tokens and 1 padding token over E = 4 experts, k = 2. Kept assignments per expert:
# e0: 4, e1: 3, e2: 2, e3: 1 (10 in all); capacity ceil(2 * 5 / 4) = 3, so e0 is 1 over.
SMALL_TOPK = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3], [1, 2], [3, 3]])
SMALL_MASK = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])


def test_moe_metrics_count_tokens_per_expert_load_ratio_and_overload() -> None:
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(12))
    metrics = moe_metrics(router_tally([logits], [SMALL_TOPK], SMALL_MASK), layer_ids=[3])
    tokens = [metrics[f"moe/layer3/expert{e}_tokens"] for e in range(4)]
    shares = [metrics[f"moe/layer3/expert{e}_share"] for e in range(4)]
    assert tokens == [4.0, 3.0, 2.0, 1.0]
    assert shares == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert metrics["moe/layer3/max_load_ratio"] == pytest.approx(4 / 2.5)
    assert metrics["moe/layer3/overloaded_frac"] == pytest.approx(1 / 10)
    assert metrics["moe/layer3/balance_loss"] == pytest.approx(
        4 * sum(s * p for s, p in zip(shares, _mean_probs(logits, SMALL_MASK), strict=True))
    )
    assert metrics["moe/layer3/z_loss"] == pytest.approx(_z_loop(logits, SMALL_MASK), rel=1e-5)


def _mean_probs(logits: torch.Tensor, mask: torch.Tensor) -> list[float]:
    kept = logits[mask > 0].double()
    return torch.softmax(kept, dim=-1).mean(0).tolist()


def test_summed_tallies_give_the_metrics_of_the_whole_step() -> None:
    # Two micro-batches (or ranks): counts add; overload is per forward (each its own
    # capacity); losses are token-weighted means; cross-layer summaries over both layers.
    first = [_routing(6, seed=s) for s in (13, 14)]
    second_logits = [torch.zeros(4, E), torch.zeros(4, E)]
    second_topk = [torch.tensor([[0, 1]] * 4), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])]
    mask_a, mask_b = torch.ones(6), torch.ones(4)
    tally = router_tally([x for x, _ in first], [ids for _, ids in first], mask_a)
    tally += router_tally(second_logits, second_topk, mask_b)
    metrics = moe_metrics(tally)

    for layer, (logits, topk) in enumerate(first):
        counts = torch.bincount(topk.reshape(-1), minlength=E)
        counts += torch.bincount(second_topk[layer].reshape(-1), minlength=E)
        tokens = [metrics[f"moe/layer{layer}/expert{e}_tokens"] for e in range(E)]
        assert tokens == counts.tolist()
        assert metrics[f"moe/layer{layer}/max_load_ratio"] == pytest.approx(
            counts.max().item() / (counts.sum().item() / E)
        )
        # Capacity: ceil(2*6/8) = 2 in the first forward, ceil(2*4/8) = 1 in the second.
        first_over = (torch.bincount(topk.reshape(-1), minlength=E) - 2).clamp(min=0).sum()
        second_over = (torch.bincount(second_topk[layer].reshape(-1), minlength=E) - 1).clamp(min=0)
        over = first_over + second_over.sum()
        assert metrics[f"moe/layer{layer}/overloaded_frac"] == pytest.approx(over.item() / 20)
        # The zero-logit forward has balance loss 1 and z-loss log(E)^2 on every token.
        balance = (6 * _balance_loop(logits, topk, mask_a) + 4 * 1.0) / 10
        z = (6 * _z_loop(logits, mask_a) + 4 * math.log(E) ** 2) / 10
        assert metrics[f"moe/layer{layer}/balance_loss"] == pytest.approx(balance, rel=1e-5)
        assert metrics[f"moe/layer{layer}/z_loss"] == pytest.approx(z, rel=1e-5)

    per_layer = [metrics[f"moe/layer{layer}/max_load_ratio"] for layer in (0, 1)]
    assert metrics["moe/max_load_ratio"] == max(per_layer)
    for name in ("balance_loss", "z_loss", "overloaded_frac"):
        layer_values = [metrics[f"moe/layer{layer}/{name}"] for layer in (0, 1)]
        assert metrics[f"moe/{name}"] == pytest.approx(sum(layer_values) / 2)


def test_router_tally_holds_no_graph() -> None:
    logits, topk = _routing(5, seed=15)
    tally = router_tally([logits.requires_grad_()], [topk], torch.ones(5))
    assert not tally.requires_grad
    assert tally.dtype == torch.float64
