"""Mixture-of-experts router losses and expert-load statistics.

Inputs, per MoE layer of one forward: the router's `logits` [N, E] over N tokens (fp32 or bf16;
computed in fp32), the experts the forward routed each token to, `topk` [N, k] (natural top-k
or, with routing replay, the engine's recorded experts; any integer dtype), and `mask` [N] (1
on the tokens to count, 0 on padding). Each loss maps them to a scalar that is differentiable
in `logits`; `router_loss` weights them into the objective's term (algorithm.router_*_coef).

Statistics: `router_tally` turns one forward's layers into sums that add across micro-batches
and data-parallel ranks, `moe_metrics` turns (added) tallies into `moe/...` metrics.
docs/algorithms.md has the formulas and their sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rl.config import AlgorithmConfig
from rl.config.registry import Registry

RouterLossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class RouterLossTraits:
    # The AlgorithmConfig field holding the loss's weight in the objective (0 = off).
    coef: str = ""


ROUTER_LOSSES: Registry[RouterLossFn, RouterLossTraits] = Registry("router loss", RouterLossTraits)


def _fp32(logits: Tensor) -> Tensor:
    """`logits` in at least fp32 (bf16 router logits lose the small differences between
    experts that softmax and logsumexp compare)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _assignments(topk: Tensor, mask: Tensor, num_experts: int) -> Tensor:
    """Routed (token, slot) assignments per expert over `mask`'s tokens, [E] float32."""
    weights = mask.to(torch.float32).unsqueeze(1).expand(topk.shape).reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=topk.device)
    return counts.index_add_(0, topk.reshape(-1).long(), weights)


@ROUTER_LOSSES.register("balance", coef="router_balance_coef")
def balance_loss(logits: Tensor, topk: Tensor, mask: Tensor) -> Tensor:
    """Load-balancing loss E * sum_e f_e P_e over `mask`'s tokens, a scalar.

    f_e: the share of routed (token, slot) assignments that went to expert e (sum_e f_e = 1;
    from `topk`, so no gradient); P_e: the mean router probability softmax(logits)_e. It is 1
    when both are uniform, and its gradient lowers the probability of overloaded experts
    (Switch Transformer eq. 4; Megatron-LM's topk-normalised form for k > 1). transformers'
    `load_balancing_loss_func` divides the counts by tokens, not assignments, so its value is k
    times this one (the tests check that), and it pools counts over layers before the product
    where `router_loss` averages per-layer losses. 0 when the mask is empty.
    """
    probs = torch.softmax(_fp32(logits), dim=-1)
    weights = mask.to(probs.dtype)
    mean_prob = (probs * weights.unsqueeze(1)).sum(0) / weights.sum().clamp(min=1.0)
    counts = _assignments(topk, mask, logits.shape[-1])
    share = counts / counts.sum().clamp(min=1.0)
    return logits.shape[-1] * (share * mean_prob).sum()


@ROUTER_LOSSES.register("z", coef="router_z_coef")
def z_loss(logits: Tensor, topk: Tensor, mask: Tensor) -> Tensor:
    """Router z-loss: the mean over `mask`'s tokens of logsumexp(logits)^2, a scalar (ST-MoE,
    Zoph et al. 2022). It keeps router logits small, where bf16 rounds them least.
    `topk` is unused. 0 when the mask is empty."""
    per_token = torch.logsumexp(_fp32(logits), dim=-1) ** 2
    weights = mask.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1.0)


def router_loss(
    logits: Sequence[Tensor], topk: Sequence[Tensor], mask: Tensor, cfg: AlgorithmConfig
) -> Tensor:
    """The objective's router term for one forward: sum over ROUTER_LOSSES of the loss's
    coefficient (its `coef` trait's field of `cfg`) times its mean over the MoE layers (one
    entry of `logits`/`topk` each). A mean over this forward's tokens: weight it by its share of
    the step's tokens when adding it to a loss summed over micro-batches and ranks."""
    assert logits and len(logits) == len(topk), "one (logits, topk) pair per MoE layer"
    total = logits[0].new_zeros((), dtype=torch.float32)
    for name in ROUTER_LOSSES.names():
        coef = getattr(cfg, ROUTER_LOSSES.traits(name).coef)
        if coef:
            loss = ROUTER_LOSSES.get(name)
            layers = [loss(x, ids, mask) for x, ids in zip(logits, topk, strict=True)]
            total = total + coef * torch.stack(layers).mean()
    return total


# Columns of a tally after its E per-expert assignment counts.
TALLY_COLUMNS = ("overloaded", *(f"{name}_loss" for name in ROUTER_LOSSES.names()), "tokens")


def router_tally(logits: Sequence[Tensor], topk: Sequence[Tensor], mask: Tensor) -> Tensor:
    """Sums over one forward's `mask`'s tokens, [L, E + len(TALLY_COLUMNS)] float64, no grad,
    that add across micro-batches and ranks (torch.distributed.all_reduce with SUM): per layer,
    the assignments to each expert, then TALLY_COLUMNS: assignments over capacity, each router
    loss times the tokens, the tokens.

    Capacity at capacity factor 1.0 is ceil(k N / E) assignments per expert for this forward's
    N tokens; our forward is dropless, so the assignments beyond it are overloaded, not dropped.
    """
    assert logits and len(logits) == len(topk), "one (logits, topk) pair per MoE layer"
    tokens = mask.to(torch.float64).sum()
    rows = []
    with torch.no_grad():
        for x, ids in zip(logits, topk, strict=True):
            counts = _assignments(ids, mask, x.shape[-1]).double()
            capacity = torch.ceil(counts.sum() / x.shape[-1])
            losses = [ROUTER_LOSSES.get(n)(x, ids, mask).double() for n in ROUTER_LOSSES.names()]
            over = (counts - capacity).clamp(min=0.0).sum()
            rows.append(
                torch.cat([counts, torch.stack([over, *(v * tokens for v in losses), tokens])])
            )
    return torch.stack(rows)


def moe_metrics(tally: Tensor, layer_ids: Sequence[int] | None = None) -> dict[str, float]:
    """Flat metrics of a `router_tally` (or a sum of them) [L, E + len(TALLY_COLUMNS)].

    Per layer (`moe/layer<id>/`, ids from `layer_ids`, default 0..L-1): `expert<e>_tokens` (the
    tokens routed to e) and `expert<e>_share` (its share of the assignments), `max_load_ratio`
    (the busiest expert's assignments over the mean, 1 = balanced, E/k = all on k experts),
    `overloaded_frac` (the share of assignments over capacity, per forward) and each router
    loss (`balance_loss`, `z_loss`: token-weighted means over the forwards). Across layers:
    `moe/max_load_ratio` (the worst layer's), the layer means `moe/overloaded_frac` and
    `moe/<name>_loss`.
    """
    tally = tally.double().cpu()  # one device transfer, not one per metric
    layer_ids = range(tally.shape[0]) if layer_ids is None else layer_ids
    assert len(layer_ids) == tally.shape[0], "one layer id per tally row"
    num_experts = tally.shape[1] - len(TALLY_COLUMNS)
    counts = tally[:, :num_experts]
    column = {name: tally[:, num_experts + i] for i, name in enumerate(TALLY_COLUMNS)}
    assignments = counts.sum(1).clamp(min=1.0)
    per_layer = {
        "max_load_ratio": counts.max(1).values * num_experts / assignments,
        "overloaded_frac": column["overloaded"] / assignments,
        **{
            name: column[name] / column["tokens"].clamp(min=1.0)
            for name in TALLY_COLUMNS
            if name.endswith("_loss")
        },
    }
    out: dict[str, float] = {}
    for row, layer in enumerate(layer_ids):
        prefix = f"moe/layer{layer}/"
        for e in range(num_experts):
            out[f"{prefix}expert{e}_tokens"] = counts[row, e].item()
            out[f"{prefix}expert{e}_share"] = (counts[row, e] / assignments[row]).item()
        out.update({prefix + name: values[row].item() for name, values in per_layer.items()})
    out["moe/max_load_ratio"] = per_layer.pop("max_load_ratio").max().item()
    out.update({f"moe/{name}": values.mean().item() for name, values in per_layer.items()})
    return out
