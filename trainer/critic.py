"""The PPO critic of one FSDP2 rank: a value model with its own process group and optimizer.

Batching and sharding follow the policy trainer (`trainer.ranks`): same full batch on every
rank, each rank its share of rows, equal micro-batch counts with dummy rows; the trainer.*
batching, packing, sharding, threads, betas and weight decay are shared with the policy.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rl.config import Config, TrainerConfig
from rl.types import Batch, ValueLoss
from trainer.fsdp import decoder_layers, reshard, shard_with_fsdp, storage_device
from trainer.loss_scale import loss_multiplier, loss_scale_for
from trainer.offload import DeviceResidency
from trainer.packing import ModelInput
from trainer.rank_local_load import materialize, meta_causal_lm
from trainer.ranks import (
    RoleRank,
    adamw_with_warmup,
    check_batching,
    gather_rows,
    init_rank,
    mini_batch_slices,
    optimizer_step,
    peak_memory_mb,
    reset_peak_memory,
)
from trainer.sequence_parallel import SequenceParallel, join, prepare_model, run_decoder

# Sums over valid tokens, all-reduced over ranks: the metrics and explained variance need them.
_SUMS = ("tokens", "clipped", "values", "returns", "returns_sq", "error", "error_sq")


class ValueModel(nn.Module):
    """A causal-LM decoder (no LM head) and a linear value head: hidden -> 1 per position."""

    def __init__(
        self,
        backbone: nn.Module,
        hidden_size: int,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        self.zero_head()
        # trainer.sequence_parallel > 1: this rank's group, as the policy's
        # (`trainer.fsdp.LogProbModel`).
        self.sequence_parallel = sequence_parallel

    @torch.no_grad()
    def zero_head(self) -> None:
        """Zero the head (sharded or not): the first values are exactly 0, a neutral baseline,
        so the first GAE advantages are the plain returns rather than noise of arbitrary scale
        from a random projection of the hidden states. The head's gradient is still non-zero
        (it is the hidden state), so after one step the backbone receives gradients too."""
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, inputs: ModelInput) -> torch.Tensor:
        """values [B, T-1] fp32 of the micro-batch `inputs` was built from.

        Aligned with `Batch`'s targets: values[:, t] is the value of the state after
        input_ids[:, :t+1], before emitting target input_ids[:, t+1]. Under sequence
        parallelism every rank of the group returns the whole micro-batch's values.
        """
        (values,) = run_decoder(self.backbone, inputs, self.sequence_parallel, self._values)
        return values

    def _values(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.head(hidden).squeeze(-1).float(),)


def load_value_model(
    path: str,
    dtype: str,
    mesh: DeviceMesh,
    cfg: TrainerConfig,
    sequence_parallel: SequenceParallel | None = None,
) -> ValueModel:
    """The decoder of the HF causal LM at `path` plus a zero value head, sharded with FSDP2
    like the policy (`trainer.fsdp.shard_with_fsdp`), each rank reading only its own rows of
    the checkpoint (`trainer.rank_local_load`); `dtype` is the compute dtype. With
    `sequence_parallel`, run as the policy does (`trainer.sequence_parallel`)."""
    causal_lm = meta_causal_lm(path)
    source = f"critic checkpoint {path!r}"
    layers = decoder_layers(causal_lm, source)
    if sequence_parallel is not None:
        prepare_model(causal_lm, sequence_parallel.size, source)
    # The LM head is dropped: a critic predicts one number.
    decoder = causal_lm.get_decoder()
    with torch.device("meta"):
        model = ValueModel(decoder, causal_lm.config.hidden_size, sequence_parallel)
    # Dropout would make the values of one batch differ between forward passes.
    model.eval()
    shard_with_fsdp(model, layers, mesh, dtype, cfg, cfg.activation_checkpointing)
    # The checkpoint names the decoder's tensors under the causal LM's name for it ("model.").
    prefix = next(name for name, child in causal_lm.named_children() if child is decoder)
    materialize(model, model.backbone, path, storage_device(cfg, mesh), prefix=f"{prefix}.")
    model.zero_head()
    return model


class ValueTrainer(RoleRank):
    """One FSDP2 rank of the critic. Plain class, no Ray."""

    def __init__(
        self,
        cfg: Config,
        value_loss: ValueLoss,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        """`value_loss` is the loss per token to minimise (`rl.algorithms.value_loss`)."""
        check_batching(cfg.trainer)
        self.cfg, self.value_loss = cfg, value_loss
        self.rank, self.world_size = rank, world_size
        self.device, mesh = init_rank(rank, world_size, master_addr, master_port, cfg.trainer)
        sp = join(self.device.type, world_size, cfg.trainer.sequence_parallel)
        # Under sequence parallelism a group's ranks hold the same values; the first counts them.
        self.counts_rows = sp is None or sp.counts_rows
        self.model = load_value_model(
            cfg.critic.path or cfg.model.path, cfg.model.dtype, mesh, cfg.trainer, sp
        )
        self.optimizer, self.scheduler = adamw_with_warmup(
            self.model.parameters(),
            cfg.critic.lr,
            cfg.trainer.betas,
            cfg.trainer.weight_decay,
            cfg.critic.warmup_steps,
        )
        self.loss_scale = loss_scale_for(cfg.model.dtype)
        self.residency = DeviceResidency(
            self.device, [self.model], self.optimizer, cfg.trainer.offload
        )

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, T-1] (fp32, CPU, 0 outside loss_mask) of `batch`; the same on every rank.

        Collective: every rank must call it with the same batch; each computes its own rows.
        """
        self.residency.ensure_on_device()
        pieces = []
        for micro, inputs, rows in self._micro_batches(batch):
            values = self.model(inputs)  # dummies run too
            if rows is not None and self.counts_rows:
                pieces.append((rows, values * micro.loss_mask))
        reshard(self.model)  # no backward follows to free the gathered parameters
        return gather_rows(pieces, batch, self.device)

    def accumulate_gradients(self, batch: Batch) -> dict[str, float]:
        """Forward/backward of one mini-batch (this rank's rows), summing gradients into .grad.

        The loss is the token mean of `self.value_loss` over the whole mini-batch:
        normalised by the global count of valid tokens, so the sharded gradients equal those of
        one process on the full `batch`. FSDP2's reduce-scatter averages over ranks, and we
        want the sum of the ranks' partial gradients, so each rank's loss is scaled by
        world_size before backward (see `PolicyTrainer.accumulate_gradients`).

        Returns the global `loss` and the token sums named in `_SUMS`.
        """
        clip = self.cfg.critic.value_clip
        # Every rank holds the whole mini-batch: the global count needs no collective.
        count = batch.loss_mask.sum().item()
        denominator = count if count > 0 else 1.0  # empty: the loss is 0
        # fp64 sums: explained variance subtracts sums of squares, which cancel badly in fp32.
        sums = torch.zeros(len(_SUMS) + 1, dtype=torch.float64, device=self.device)  # + loss
        for micro, inputs, _ in self._micro_batches(batch):
            mask = micro.loss_mask
            values = self.model(inputs)
            token_loss = self.value_loss(
                values, micro.old_values, micro.returns, mask, clip
            )  # masked
            loss = token_loss.sum() / denominator
            (loss * self.world_size * loss_multiplier(self.loss_scale)).backward()
            if not self.counts_rows:  # the group's first rank adds them
                continue
            with torch.no_grad():
                # Clipped where the clipped branch is the larger loss (its gradient is zero).
                unclipped = self.value_loss(values, micro.old_values, micro.returns, mask, 0.0)
                returns, error = micro.returns.double(), (micro.returns - values).double()
                terms = (
                    mask,
                    (token_loss > unclipped).float(),
                    values,
                    returns,
                    returns.square(),
                    error,
                    error.square(),
                )
                sums[: len(_SUMS)] += torch.stack([(t.double() * mask).sum() for t in terms])
                sums[-1] += loss
        dist.all_reduce(sums)
        *token_sums, loss_sum = sums.tolist()
        return {**dict(zip(_SUMS, token_sums, strict=True)), "loss": loss_sum}

    def train_step(self, batch: Batch) -> dict[str, float]:
        """trainer.num_epochs passes over `batch`, trainer.num_mini_batches optimizer steps each.

        `batch.returns` are the targets; `batch.old_values` (the values at generation) anchor
        the clipping when critic.value_clip > 0. An optimizer step whose loss or gradient norm
        is NaN/inf is skipped (`trainer.ranks.optimizer_step`), and counted in
        critic/nonfinite_skipped. The other metrics describe the steps taken only (all NaN when
        every step was skipped): value_loss and grad_norm are means over them, value_clip_frac
        and values_mean token means, and explained_variance 1 - Var[R - V] / Var[R] over their
        valid tokens (values as predicted before each update); lr is the last step's lr (for a
        skipped one, the lr the next step will use). Plus timing/critic_step_s, and
        memory/critic_peak_mb, the largest rank's peak during the step.
        """
        if batch.returns is None or batch.old_values is None:
            raise ValueError("critic train_step needs batch.returns and batch.old_values")
        mini_batches = mini_batch_slices(batch.num_sequences, self.cfg.trainer.num_mini_batches)
        self.residency.ensure_on_device()
        reset_peak_memory(self.device)
        start = time.perf_counter()
        totals = dict.fromkeys(_SUMS, 0.0)
        loss_sum = grad_norm_sum = 0.0
        steps = skipped = 0
        for _ in range(self.cfg.trainer.num_epochs):
            for rows in mini_batches:
                sums = self.accumulate_gradients(batch.select(rows))
                step = optimizer_step(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    self.cfg.critic.max_grad_norm,
                    loss=sums["loss"],
                    loss_scale=self.loss_scale,
                )
                if step.skipped:  # its sums are typically NaN and describe no update
                    skipped += 1
                    continue
                for name in totals:
                    totals[name] += sums[name]
                loss_sum += sums["loss"]
                grad_norm_sum += step.grad_norm
                steps += 1
        n = max(totals["tokens"], 1.0)
        returns_var = totals["returns_sq"] / n - (totals["returns"] / n) ** 2
        error_var = totals["error_sq"] / n - (totals["error"] / n) ** 2
        # (Near-)constant returns, e.g. equal rewards at gamma 1, have nothing to explain:
        # report 0 rather than dividing by a variance that is rounding noise.
        explained = 1.0 - error_var / returns_var if returns_var > 1e-8 else 0.0
        metrics = {
            "critic/value_loss": loss_sum / max(steps, 1),
            "critic/value_clip_frac": totals["clipped"] / n,
            "critic/values_mean": totals["values"] / n,
            "critic/grad_norm": grad_norm_sum / max(steps, 1),
            "critic/explained_variance": explained,
        }
        if steps == 0:  # no update to describe (MetricsLogger writes NaN as null)
            metrics = dict.fromkeys(metrics, math.nan)
        return {
            **metrics,
            "critic/nonfinite_skipped": float(skipped),
            "critic/lr": step.lr,
            **({} if self.loss_scale is None else {"critic/loss_scale": self.loss_scale.scale}),
            "timing/critic_step_s": time.perf_counter() - start,
            "memory/critic_peak_mb": peak_memory_mb(self.device),
        }

    def _trained(self) -> nn.Module:
        return self.model
