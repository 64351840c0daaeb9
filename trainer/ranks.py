"""What every FSDP2 role (policy, critic) does the same way on its rank.

Data parallelism: every rank receives the same full `Batch` and works on its share of rows
(`trainer.micro_batching`). Every rank must issue the same sequence of FSDP forward/backward
calls (each one runs collectives), so every rank plans the micro-batches of all ranks, and a
rank that runs out of micro-batches runs a dummy row with zero loss weight instead of skipping
a call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rl.config import Config, TrainerConfig
from rl.observe.memory import peak_rss_bytes, reset_peak_rss, reuse_freed_host_memory
from rl.types import Batch
from trainer.checkpoint import load_training_state, save_training_state
from trainer.fsdp import reshard, sharding_mesh
from trainer.loss_scale import LossScale
from trainer.micro_batching import num_micro_batches, plan_micro_batches, rank_rows
from trainer.offload import DeviceResidency
from trainer.packing import ModelInput, packed_input, padded_input
from trainer.prompt_sharing import shared_prompt_input
from trainer.sequence_parallel import padded_width

T = TypeVar("T")


def mini_batch_slices(num_rows: int, num_mini_batches: int) -> list[slice]:
    """A `num_rows` batch as `num_mini_batches` contiguous near-equal slices (as `rank_rows`).

    ValueError when there are fewer rows than mini-batches (an empty optimizer step).
    """
    if num_mini_batches > num_rows:
        raise ValueError(
            f"trainer.num_mini_batches={num_mini_batches} exceeds the {num_rows} sequences in "
            "the batch"
        )
    return [rank_rows(num_rows, i, num_mini_batches) for i in range(num_mini_batches)]


def check_batching(cfg: TrainerConfig) -> None:
    """Micro-batch, mini-batch and epoch counts are at least one (the recipe checks refuse
    the rest before any rank starts)."""
    for name in ("micro_batch_size", "num_mini_batches", "num_epochs"):
        assert getattr(cfg, name) >= 1, f"recipe checks refuse trainer.{name} < 1"


def init_rank(
    rank: int, world_size: int, master_addr: str, master_port: int, cfg: TrainerConfig
) -> tuple[torch.device, DeviceMesh]:
    """Join the process group at master_addr:master_port; returns (this rank's device, the
    mesh `cfg.sharding` shards over, `trainer.fsdp.sharding_mesh`).

    CUDA when present (nccl for tensors, gloo for CPU-side collectives), else gloo on CPU with
    `cfg.num_threads` intra-op threads, activations reusing freed host memory
    (`rl.observe.memory.reuse_freed_host_memory`). Blocks until all `world_size` ranks have joined.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.num_threads)
        reuse_freed_host_memory()
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
    )
    return device, sharding_mesh(device.type, world_size, cfg)


def reset_peak_memory(device: torch.device) -> None:
    """Start a peak-memory window: CUDA's allocator peak, or this process's resident peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory_mb(device: torch.device) -> float:
    """The largest rank's peak since `reset_peak_memory`, MiB (collective: every rank calls
    it): allocated CUDA memory, or resident memory on CPU."""
    local = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    peak = torch.tensor([float(local)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() / (1 << 20)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. From host memory to a GPU through pinned memory, without blocking:
    a blocking copy first waits for every kernel queued before it (the last micro-batch's
    backward), and the GPU would idle while the host prepares the next micro-batch."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_device(value: T, device: torch.device) -> T:
    """A copy of the dataclass `value` (a `Batch`, a `ModelInput`) with every tensor on
    `device` (`tensor_to_device`), those in tuples and in the dataclasses it holds too; the
    rest as is."""

    def moved(item: object) -> object:
        if isinstance(item, torch.Tensor):
            return tensor_to_device(item, device)
        if isinstance(item, tuple):
            return tuple(moved(part) for part in item)
        if dataclasses.is_dataclass(item):
            return to_device(item, device)
        return item

    return type(value)(**{f.name: moved(getattr(value, f.name)) for f in dataclasses.fields(value)})


def micro_batches(
    batch: Batch, rank: int, world_size: int, cfg: TrainerConfig, device: torch.device
) -> Iterator[tuple[Batch, ModelInput, torch.Tensor | None]]:
    """(micro-batch, its model input, its rows of `batch`) for this rank, both on `device`;
    every rank yields the same number.

    Rows as `trainer.micro_batching.plan_micro_batches` deals them. Each micro-batch is cut to
    its own longest row, so right padding beyond it is never computed (with a token budget its
    rows are of similar lengths: little padding is left within). Its model input is those
    rows padded or, with `cfg.packing`, packed into rows as wide as the mini-batch's longest
    sample (`trainer.packing`), or with `cfg.share_prompts` one row per prompt
    (`trainer.prompt_sharing`). Losses and gradients are sums over rows, so the order changes
    nothing but rounding.

    A rank with fewer micro-batches than another gets dummies (the batch's first row with an
    empty loss mask; rows None) so that it still takes part in every FSDP collective.

    With `cfg.sequence_parallel` = N, rows are dealt to the world_size / N groups of N
    consecutive ranks, and every rank of a group gets the group's micro-batches (each runs
    1/N of their positions: a token budget holds N times the positions).
    """
    assert batch.num_sequences > 0, "empty batch"
    lengths = batch.attention_mask.sum(dim=1).tolist()
    sp = cfg.sequence_parallel
    plan = plan_micro_batches(
        lengths, world_size // sp, cfg.micro_batch_size, cfg.micro_batch_tokens * sp, cfg.packing
    )
    # Of packed rows: the mini-batch's longest sample, a multiple of a sequence-parallel
    # group's size (each rank holds an equal chunk of every row).
    width = padded_width(max(lengths), sp)

    def build(micro: Batch) -> ModelInput:
        if cfg.share_prompts:
            return shared_prompt_input(micro)
        return packed_input(micro, width) if cfg.packing else padded_input(micro)

    mine = plan[rank // sp]
    for i in range(num_micro_batches(plan)):
        if i < len(mine):
            rows = torch.tensor(mine[i])
            micro = batch.select(rows).trim(max(lengths[row] for row in mine[i]))
        else:
            rows, row = None, batch.select(slice(0, 1))
            micro = dataclasses.replace(row, loss_mask=torch.zeros_like(row.loss_mask))
        yield to_device(micro, device), to_device(build(micro), device), rows


def scatter_rows(
    pieces: list[tuple[torch.Tensor, torch.Tensor]], batch: Batch, device: torch.device
) -> torch.Tensor:
    """[B, T-1] fp32 on `device` from (rows, [len(rows), <= T-1]) pieces of `micro_batches`
    output; rows no piece covers and columns a trimmed piece lacks are 0."""
    out = torch.zeros(batch.num_sequences, batch.input_ids.shape[1] - 1, device=device)
    for rows, values in pieces:
        out[tensor_to_device(rows, device), : values.shape[1]] = values.float()
    return out


def gather_rows(
    pieces: list[tuple[torch.Tensor, torch.Tensor]], batch: Batch, device: torch.device
) -> torch.Tensor:
    """`scatter_rows` of every rank's pieces, on CPU. Collective: each rank contributes its own
    rows (under sequence parallelism, one rank a group: `SequenceParallel.counts_rows`) and
    every rank gets the whole [B, T-1]."""
    out = scatter_rows(pieces, batch, device)
    dist.all_reduce(out)  # each row is written by exactly one rank
    return out.cpu()


def adamw_with_warmup(
    params: Iterable[nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and a schedule: linear warmup over `warmup_steps` optimizer steps, then constant."""
    # Fused: one kernel a parameter instead of a dozen foreach ops, each of which dispatches
    # through DTensor.
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0,
    )
    return optimizer, scheduler


class StepResult(NamedTuple):
    """What `optimizer_step` did: identical on every rank (its inputs are global)."""

    grad_norm: float  # pre-clip global gradient norm (NaN/inf when that caused the skip)
    lr: float  # the lr the step used; when skipped, the lr the next step will use
    skipped: bool  # non-finite loss or gradient: nothing was updated


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
    *,
    loss: float,
    loss_scale: LossScale | None = None,
) -> StepResult:
    """Clip `model`'s gradients to `max_grad_norm`, step optimizer and schedule, zero grads.

    `loss` is the step's global (all-reduced) loss. If it or the global grad norm is NaN/inf
    the step is skipped: no clip, no optimizer or scheduler step, so parameters, Adam moments
    and step counts and the lr schedule stay exactly as they were; the grads are still zeroed
    so the bad ones do not leak into the next step. Collective: the norm of DTensor shards is
    completed across ranks.

    With `loss_scale` (fp16), the gradients of the scaled loss are divided by its scale first,
    so the norm, the clip and the step see the true ones; then the scale learns from the skip
    decision (`trainer.loss_scale`).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if loss_scale is not None:
        torch._foreach_div_([p.grad for p in params], loss_scale.scale)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(grad_norm, DTensor):  # partial norms of the shards -> the global norm
        grad_norm = grad_norm.full_tensor()
    norm = grad_norm.item()
    lr = optimizer.param_groups[0]["lr"]
    # Every rank must take the same decision, or the shards' optimizer states and lr diverge:
    # they do, because both inputs are global (the all-reduced norm and the all-reduced loss),
    # so a NaN on any one rank's rows reaches every rank.
    skipped = not (math.isfinite(norm) and math.isfinite(loss))
    if not skipped:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if loss_scale is not None:
        loss_scale.update(skipped)
    return StepResult(norm, lr, skipped)


class RoleRank:
    """What a policy or critic rank does the same way with its state. A subclass sets the
    attributes and says which module it trains (`_trained`)."""

    cfg: Config
    rank: int
    world_size: int
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_scale: LossScale | None
    residency: DeviceResidency

    def _trained(self) -> nn.Module:
        """The FSDP2 root of the trained model."""
        raise NotImplementedError

    def release_memory(self) -> None:
        """Hand this rank's device memory to a colocated rollout engine until the next call
        that computes (`trainer.offload`)."""
        self.residency.release()

    def _micro_batches(
        self, batch: Batch
    ) -> Iterator[tuple[Batch, ModelInput, torch.Tensor | None]]:
        """(micro-batch, model input, its rows) of this rank (`micro_batches`)."""
        return micro_batches(batch, self.rank, self.world_size, self.cfg.trainer, self.device)

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's shards of the trained model, its optimizer, schedule and fp16 loss
        scale into `directory` (collective; frozen models are their checkpoints and not saved)."""
        self.residency.ensure_on_device()
        reshard(self._trained())
        save_training_state(Path(directory), self.rank, *self._checkpointed())

    def load_checkpoint(self, directory: str) -> None:
        """Continue from what `save_checkpoint` wrote (collective)."""
        self.residency.ensure_on_device()
        load_training_state(Path(directory), self.rank, *self._checkpointed())

    def _checkpointed(self) -> tuple:
        """What a checkpoint holds: the model, its optimizer, schedule and fp16 loss scale."""
        return self._trained(), self.optimizer, self.scheduler, self.loss_scale

    def close(self) -> None:
        """Leave the process group (the last call on this object)."""
        dist.destroy_process_group()
