"""A mixture of experts' part of a training mini-batch: the router losses added to each
micro-batch's loss, and the routing metrics summed over its micro-batches and the ranks.

The policy's forward (trainer.fsdp.LogProbModel) keeps each MoE layer's last router call
(rl.expert_routing): its logits, the experts it would choose and the experts it used (the
replayed ones under model.routing_replay). The losses and the expert-load tally are the
objective's (rl.algorithms.router_losses); replay adds how often the router's own choice
departs from the engine's record.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl.expert_routing import ExpertRouting, disagreement
from rl.types import PolicyObjective
from trainer.packing import ModelInput


class MoEMiniBatch:
    """One mini-batch's router terms and tallies; `add` after each micro-batch's forward,
    `metrics` once every micro-batch ran (a collective)."""

    def __init__(
        self,
        routing: ExpertRouting,
        objective: PolicyObjective,
        num_tokens: int,
        device: torch.device,
        counts: bool = True,
    ) -> None:
        """`num_tokens`: the real tokens of the whole mini-batch, over every rank's rows.
        `counts`: whether this rank's tallies count (under sequence parallelism the ranks of a
        group hold the same ones, and the first counts them)."""
        self._routing, self._objective, self._counts = routing, objective, counts
        self._num_tokens = max(num_tokens, 1)
        self._tally: torch.Tensor | None = None
        self._replay = torch.zeros(2, device=device)  # (pairs that differ, pairs)

    def add(self, inputs: ModelInput) -> torch.Tensor:
        """The router loss of the forward just run over `inputs`, weighted by its share of the
        mini-batch's tokens (the policy loss is summed over micro-batches and ranks alike)."""
        calls = self._routing.calls
        real = inputs.real.flatten()
        logits = [call.logits for call in calls]
        used = [call.used for call in calls]
        tally = self._objective.router_tally(logits, used, real)
        self._tally = tally if self._tally is None else self._tally + tally
        if inputs.routing is not None:
            self._replay += disagreement(calls, inputs.routing.flatten(0, 1))
        share = real.sum() / self._num_tokens
        return self._objective.router_loss(logits, used, real) * share

    def metrics(self) -> dict[str, float]:
        """moe/* of the mini-batch: expert load and router losses per layer and overall, and
        moe/replay_disagreement, the share of (replayed token, layer) pairs whose router
        would have chosen other experts than the record's. Collective."""
        assert self._tally is not None, "no micro-batch added"
        if not self._counts:
            self._tally.zero_()
            self._replay.zero_()
        dist.all_reduce(self._tally)
        dist.all_reduce(self._replay)
        # One read from the device for both (each read waits for the queued work); the
        # replay counts are whole numbers, exact in float64.
        host = torch.cat([self._tally.flatten(), self._replay.double()]).cpu()
        out = self._objective.router_metrics(host[:-2].view(self._tally.shape))
        differ, pairs = host[-2:].tolist()
        if pairs:
            out["moe/replay_disagreement"] = differ / pairs
        return out
