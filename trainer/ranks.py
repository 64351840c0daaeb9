"""What every FSDP2 role (policy, critic) does the same way on its rank.

Data parallelism: every rank receives the same full `Batch` and works on its contiguous share
of rows (`rank_rows`). Every rank must issue the same sequence of FSDP forward/backward calls
(each one runs collectives), so micro-batch counts come from global sizes, and a rank that runs
out of rows runs a dummy row with zero loss weight instead of skipping a call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from rl.config import TrainerConfig
from rl.memory import peak_rss_bytes, reset_peak_rss
from rl.types import Batch


def rank_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """Rows of a `num_rows` batch that `rank` owns: contiguous, sizes differ by at most one.

    The first `num_rows % world_size` ranks get one extra row, so concatenating the ranks'
    outputs in rank order restores the batch order. The driver uses this to reassemble.
    """
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


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
    """Reject micro-batch / mini-batch / epoch counts below one (a user error)."""
    for name in ("micro_batch_size", "num_mini_batches", "num_epochs"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"trainer.{name}={getattr(cfg, name)} < 1")


def init_rank(
    rank: int, world_size: int, master_addr: str, master_port: int, num_threads: int
) -> tuple[torch.device, DeviceMesh]:
    """Join the process group at master_addr:master_port; returns (this rank's device, 1-D mesh).

    CUDA when present (nccl for tensors, gloo for CPU-side collectives), else gloo on CPU with
    `num_threads` intra-op threads. Blocks until all `world_size` ranks have joined.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(num_threads)
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
    )
    return device, init_device_mesh(device.type, (world_size,))


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


def batch_to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of `batch` on `device` (absent optional fields stay None)."""
    moved = {
        f.name: None if (t := getattr(batch, f.name)) is None else t.to(device)
        for f in dataclasses.fields(batch)
    }
    return Batch(**moved)


def micro_batches(
    batch: Batch, rank: int, world_size: int, micro_batch_size: int, device: torch.device
) -> Iterator[tuple[Batch, torch.Tensor | None]]:
    """(micro-batch on device, its rows) for this rank's rows; the same count on every rank.

    The rank's rows go longest first, so that each micro-batch holds rows of similar length,
    and each is cut to its own longest row: right padding beyond it is never computed (a
    batch whose lengths vary 4x spends a third of a padded pass on padding). `rows` are the
    micro-batch's row positions within the rank's rows, for `scatter_rows`. Losses and
    gradients are sums over rows, so the order changes nothing but rounding.

    The count is set by the rank with the most rows. A rank short of rows gets a dummy
    micro-batch (the batch's first row with an empty loss mask; rows None) so that it still
    takes part in every FSDP collective.
    """
    assert batch.num_sequences > 0, "empty batch"
    mine = rank_rows(batch.num_sequences, rank, world_size)
    lengths = batch.attention_mask[mine].sum(dim=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    most_rows = math.ceil(batch.num_sequences / world_size)
    for i in range(max(1, math.ceil(most_rows / micro_batch_size))):
        rows = order[i * micro_batch_size : (i + 1) * micro_batch_size]
        if len(rows):
            micro = batch.select(rows + mine.start).trim(int(lengths[rows].max()))
            yield batch_to_device(micro, device), rows
        else:
            row = batch.select(slice(0, 1))
            dummy = dataclasses.replace(row, loss_mask=torch.zeros_like(row.loss_mask))
            yield batch_to_device(dummy, device), None


def scatter_rows(
    pieces: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, num_steps: int
) -> torch.Tensor:
    """[num_rows, num_steps] from (rows, [len(rows), <= num_steps]) pieces of micro_batches'
    output, in the rank's row order; columns a trimmed piece lacks are 0 (padding)."""
    out = torch.zeros(num_rows, num_steps)
    for rows, values in pieces:
        out[rows, : values.shape[1]] = values
    return out


def adamw_with_warmup(
    params: Iterable[nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and a schedule: linear warmup over `warmup_steps` optimizer steps, then constant."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
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
) -> StepResult:
    """Clip `model`'s gradients to `max_grad_norm`, step optimizer and schedule, zero grads.

    `loss` is the step's global (all-reduced) loss. If it or the global grad norm is NaN/inf
    the step is skipped: no clip, no optimizer or scheduler step, so parameters, Adam moments
    and step counts and the lr schedule stay exactly as they were; the grads are still zeroed
    so the bad ones do not leak into the next step. Collective: the norm of DTensor shards is
    completed across ranks.
    """
    params = [p for p in model.parameters() if p.grad is not None]
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
    return StepResult(norm, lr, skipped)
