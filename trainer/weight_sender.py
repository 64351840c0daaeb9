"""The sending side of weight sync on one trainer rank: its own FSDP2 shard rows, straight into
shared memory. Sharded over all ranks (zero2, zero3) there is no all-gather: every rank writes
only the rows it holds."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from rl.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rl.sync.plan import AttentionShape, TensorSpec, WeightSyncPlan, load_unit, owned_rows
from rl.sync.transport import ChannelSpec, ExportingChannel, open_channel


def trained_tensors(model: nn.Module) -> list[TensorSpec]:
    """The parameters a sync sends, in model order, under HF names: trainable ones only (frozen
    ones never change, the rollout has them from the checkpoint), tied ones once.

    vLLM reloads a layer only whole, so a layer fused from several HF tensors (q/k/v, gate/up)
    must be frozen whole or not at all.
    """
    specs, trainable_by_unit = [], {}
    for name, param in model.named_parameters():  # tied parameters appear once
        trainable_by_unit.setdefault(load_unit(name), {})[name] = param.requires_grad
        if param.requires_grad:
            specs.append(TensorSpec(name, tuple(param.shape)))  # a DTensor's global shape
    for unit, trainable in trainable_by_unit.items():
        if len(set(trainable.values())) > 1:
            frozen = sorted(name for name, grad in trainable.items() if not grad)
            raise ValueError(
                f"model.frozen freezes {frozen} but not the rest of {unit}, which vLLM loads "
                f"as one layer: freeze all of {sorted(trainable)} or none"
            )
    return specs


def attention_shape(config: PretrainedConfig) -> AttentionShape:
    """The slicing-relevant sizes of a Llama/Qwen-style HF config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return AttentionShape(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
    )


class WeightSender:
    """Sends trainer `rank`'s rows of each bucket of `plan` over the channel `channel_spec`
    (`rl.sync.transport.open_channel`)."""

    def __init__(
        self, model: nn.Module, plan: WeightSyncPlan, rank: int, channel_spec: ChannelSpec
    ) -> None:
        self._model, self.plan, self._rank = model, plan, rank
        self._channel = open_channel(plan, channel_spec, member=rank)
        self._base_rss = 0

    def export(self) -> object | None:
        """Where the readers find what this rank's channel made (`ExportingChannel`), or None
        for a transport whose readers need nothing from it."""
        return self._channel.export() if isinstance(self._channel, ExportingChannel) else None

    @torch.no_grad()
    def rows(self, bucket: int) -> dict[str, torch.Tensor]:
        """This rank's rows of each tensor of `bucket`, as the model holds them now. The model
        must be resharded (FSDP2 swaps in full parameters while unsharded)."""
        params = dict(self._model.named_parameters())
        return {
            spec.name: self._rows(params[spec.name].detach()) for spec in self.plan.buckets[bucket]
        }

    def write(
        self, bucket: int, rows: dict[str, torch.Tensor], replicas: list[int] | None = None
    ) -> dict[str, float]:
        """Send `rows` (of `bucket`: `rows()` now, or a copy kept from an earlier push) to
        rollout engines `replicas` (None: all).

        Returns the seconds it took and the peak extra resident bytes since bucket 0.
        """
        start = time.perf_counter()
        if bucket == 0:
            self._base_rss = rss_bytes()
            reset_peak_rss()
        self._channel.write(bucket, rows, replicas)
        return {
            "seconds": time.perf_counter() - start,
            "peak_extra_bytes": float(max(peak_rss_bytes() - self._base_rss, 0)),
        }

    def _rows(self, param: torch.Tensor) -> torch.Tensor:
        """The dim-0 rows the plan has this rank send (`owned_rows`): its own FSDP2 shard when
        sharded over all ranks (zero2, zero3) or the whole tensor at W = 1; otherwise (a 2-D
        mesh: hybrid, none) the rank holds other rows than these, so they are cut from the
        whole tensor: its own with sharding none, else gathered (a collective, which every rank
        runs for every tensor)."""
        if not isinstance(param, DTensor):
            return param
        mesh = param.device_mesh
        if mesh.ndim == 1:
            return param.to_local()
        whole = param.to_local() if mesh.size(1) == 1 else param.full_tensor()
        start, stop = owned_rows(param.shape[0], self._rank, self.plan.world_size)
        return whole[start:stop]
