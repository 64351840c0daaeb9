"""Which experts a mixture-of-experts model's routers choose: recorded where the model
generates, replayed where the trainer scores the same tokens (rollout routing replay, R3).

transformers' MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral and the models that reuse their
blocks) call a router module `mlp.gate` that returns, for the block's N tokens flattened from
[rows, positions] in row-major order, (router logits [N, E], the top-k gate weights [N, k],
the top-k expert ids [N, k]). A forward hook on each router reads the ids (recording, and the
statistics of the natural choice) or replaces them (replay). Replayed ids keep the router
differentiable as the R3 paper does: the gate weights are the router's own softmax
probabilities at the replayed experts, renormalised as the model renormalises its top-k, so
the router still learns from the loss; only the choice is forced.

A routing record is an integer tensor [positions, MoE layers, k] of expert ids, one row per
position of a sequence the model ran over; -1 in a row means "route naturally" (positions
nobody recorded). Ids are stored as uint8 when every expert id fits in it, else int16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

NATURAL = -1  # a record row's ids when the position routes as the router chooses


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every mixture-of-experts layer of `model`'s decoder, in layer order
    ([] for a dense model). Layers whose MLP has no experts (Qwen2-MoE's `mlp_only_layers`)
    have none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return []
    routers = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            routers.append(mlp.gate)
    return routers


def record_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype a record of `num_experts`' ids is stored in (with room for -1
    only where records are padded: stored records hold real ids)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RouterCall:
    """One router's last call: its logits [N, E], the ids it chose itself [N, k], and the ids
    the block used [N, k] (the replayed ones where a record forced them)."""

    logits: torch.Tensor
    natural: torch.Tensor
    used: torch.Tensor


@dataclass
class ExpertRouting:
    """Forward hooks on `model`'s routers. While `replay` is set ([N, layers, k] long, laid
    out as the routers see the tokens: the forward's [rows, positions] flattened), each router
    uses its rows' recorded ids where they are not NATURAL. Every call's `RouterCall` is kept
    in `calls`, one per layer, until the next forward replaces it.

    Replay stays set until replaced or cleared, on purpose: under activation checkpointing a
    layer's forward runs again during backward and must route as it did the first time.
    """

    model: nn.Module
    replay: torch.Tensor | None = None
    calls: list[RouterCall | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.routers = moe_routers(self.model)
        self.calls = [None] * len(self.routers)
        self._handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(self.routers)
        ]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(router: nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, weights, natural = output
            if self.replay is None:
                self.calls[layer] = RouterCall(logits, natural, natural)
                return None
            forced = self.replay[:, layer].to(natural.device)
            assert forced.shape == natural.shape, (
                f"routing record rows {tuple(forced.shape)} for a router call of "
                f"{tuple(natural.shape)}"
            )
            used = torch.where(forced == NATURAL, natural, forced)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            gates = probs.gather(-1, used)
            # Renormalise as the router renormalises its own top-k: Qwen-MoE when
            # norm_topk_prob is set, Mixtral (no such attribute) always.
            if getattr(router, "norm_topk_prob", True):
                gates = gates / gates.sum(dim=-1, keepdim=True)
            self.calls[layer] = RouterCall(logits, natural, used)
            return logits, gates.to(weights.dtype), used

        return hook

    def recorded(self) -> torch.Tensor:
        """The ids every layer used in the last forward: [N, layers, k] long."""
        assert all(call is not None for call in self.calls), "no forward since the hooks"
        return torch.stack([call.used for call in self.calls], dim=1)

    @contextlib.contextmanager
    def replaying(self, record: torch.Tensor | None) -> Iterator[None]:
        """Replay `record` ([N, layers, k]) in the forwards run inside; None routes naturally.
        The record stays set after the block (see the class docstring)."""
        if record is not None:
            assert record.shape[1:] == (self.num_layers, self.top_k), (
                f"a routing record of {tuple(record.shape[1:])} per position for "
                f"{self.num_layers} MoE layers of top-{self.top_k}"
            )
            record = record.long()
        self.replay = record
        yield


def disagreement(calls: list[RouterCall], record: torch.Tensor) -> torch.Tensor:
    """(pairs that differ, pairs) as a [2] float tensor over the recorded (token, layer) pairs
    of the last forward (`record` [N, layers, k], NATURAL where nothing was recorded): pairs
    whose router chose itself another top-k set than the record's. Stays on the device (no
    sync): the caller sums it over micro-batches and ranks."""
    record = record.long()
    forced = (record != NATURAL).any(dim=(1, 2))
    differ = forced.new_zeros((), dtype=torch.float32)
    for layer, call in enumerate(calls):
        natural = call.natural.sort(dim=-1).values
        recorded = record[:, layer].to(natural.device).sort(dim=-1).values
        differ = differ + ((natural != recorded).any(dim=-1) & forced).sum()
    return torch.stack([differ, forced.sum().float() * len(calls)])
