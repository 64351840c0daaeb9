"""How often a training mini-batch makes the host wait for the device.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `.cpu()`, a Python
`if` on a tensor, an output whose size depends on values, as `nonzero`'s) waits for all the
work queued before it, and the GPU idles until the host queues more. A mini-batch may read
once when its metrics are complete; inside the micro-batch loop every read costs a drained
queue per micro-batch. This machine has no GPU, so the test tracks which tensors would live
on one: those `micro_batches` yields (it moves them there) and every tensor computed from
them or created outside it. What `micro_batches` computes from the host batch stays host
data. Each read of a device tensor is counted by the file that made it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.types import Batch
from tests.helpers.fsdp_ranks import make_batch, trainer_config
from tests.helpers.models import build_moe_checkpoint
from tests.helpers.repo import REPO
from trainer.packing import ModelInput
from trainer.policy import PolicyTrainer

aten = torch.ops.aten
# Operators that read device values on the host: a scalar, a comparison's answer, or the size
# of a data-dependent output.
READING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(), float(), int()
    aten.nonzero.default,
    aten.equal.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}
# Tensor methods that copy to the host: on a CPU tensor no operator runs, so they are
# caught where Python calls them.
READING_METHODS = {"tolist", "cpu", "numpy"}
FACTORIES_OF_DATA = {aten.lift_fresh.default}  # torch.tensor(python data)


def _reader() -> str:
    """The innermost caller in this repository or in transformers, as a path below it."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if "transformers" in path.parts:
            return "transformers/" + path.name
        if (
            path.is_relative_to(REPO)
            and ".venv" not in path.parts
            and path.name != Path(__file__).name
        ):
            return str(path.relative_to(REPO))
    return "?"


class DeviceReads(TorchDispatchMode):
    """Counts reads of device tensors (by the storage they view: views and in-place writes
    are tracked too) by the file that made them."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, torch.UntypedStorage] = {}  # kept alive: no id is reused
        self.on_host = False  # True while micro_batches builds from the host batch
        self.paused = False  # True while a host copy is made (on CPU it would share storage)
        self.by_file: collections.Counter[str] = collections.Counter()

    def to_device(self, *values: object) -> None:
        """Mark `values` (tensors, or dataclasses of them) as on the device."""
        for value in values:
            if dataclasses.is_dataclass(value):
                self.to_device(*(getattr(value, f.name) for f in dataclasses.fields(value)))
            elif isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                self._device[storage._cdata] = storage

    def on_device(self, *values: object) -> bool:
        return any(
            isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self._device
            for t in tree_flatten(values)[0]
        )

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        created = not inputs or func in FACTORIES_OF_DATA
        if (created and not self.on_host) or self.on_device(args, kwargs):
            if func in READING_OPS or (
                func is aten.index.Tensor
                and any(i is not None and i.dtype == torch.bool for i in args[1])
            ):
                self.by_file[_reader()] += 1
            self.to_device(*tree_flatten(out)[0])
        return out


class HostCopies(TorchFunctionMode):
    """The Tensor methods that copy to the host, counted into `reads` for device tensors."""

    def __init__(self, reads: DeviceReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in READING_METHODS and self.reads.on_device(args):
            self.reads.by_file[_reader()] += 1
            if isinstance(out, torch.Tensor):  # a host copy, as it would be from a GPU
                self.reads.paused = True
                out = out.clone()
                self.reads.paused = False
        return out


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _one_rank(
    model_dir: Path, micro_batch_size: int, **algorithm: object
) -> Iterator[PolicyTrainer]:
    """A one-rank trainer with packed micro-batches of `micro_batch_size` rows."""
    cfg = trainer_config(
        model_dir, algorithm, num_workers=1, packing=True, micro_batch_size=micro_batch_size
    )
    rank = PolicyTrainer(cfg, Objective.from_config(cfg), 0, 1, "127.0.0.1", _port())
    try:
        yield rank
    finally:
        rank.close()


def _count_reads(
    trainer: PolicyTrainer, monkeypatch: pytest.MonkeyPatch, work: Callable[[], object]
) -> collections.Counter[str]:
    """The device reads of `work()` by file, micro_batches' host-side building left out."""
    reads = DeviceReads()
    plan = trainer._micro_batches

    def tracked(batch: Batch) -> Iterator[tuple[Batch, ModelInput, torch.Tensor | None]]:
        micro_batches = plan(batch)
        while True:
            reads.on_host = True
            item = next(micro_batches, None)
            reads.on_host = False
            if item is None:
                return
            micro, inputs, _ = item
            reads.to_device(micro, inputs)
            yield item

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "_micro_batches", tracked)
        with HostCopies(reads), reads:
            work()
    return reads.by_file


def _batch(model_dir: Path, seed: int) -> Batch:
    """Six rows of up to 20 tokens, behaviour log-probs those of the old policy."""
    batch = make_batch(AutoModelForCausalLM.from_pretrained(model_dir), 6, 20, seed=seed)
    batch.behaviour_logprobs = batch.old_logprobs
    return batch


# Per forward, one read outside the trainer's own code: the LM-head kernel reads how many
# targets it scores (the size of its work). The number is known on the host, where
# trainer.packing builds the rows, but the kernel does not take it from there. (Packed rows'
# sample boundaries come from the host too: `kernels.attention.Segments`.)
def _per_forward(num_forwards: int) -> dict[str, int]:
    return {"kernels/__init__.py": num_forwards}


@pytest.mark.parametrize("num_micro_batches", [1, 3])
def test_a_mini_batch_reads_the_device_once_for_its_metrics_and_once_per_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_micro_batches: int
) -> None:
    batch = _batch(tiny_model_dir, seed=0)
    # An off-policy correction from the training forward, KL and entropy terms: every metric.
    with _one_rank(tiny_model_dir, 6 // num_micro_batches, off_policy="token-tis") as rank:
        reads = _count_reads(rank, monkeypatch, lambda: rank.accumulate_gradients(batch))
    assert reads == {"trainer/policy.py": 1, **_per_forward(num_micro_batches)}


def test_a_mixture_of_experts_adds_one_read_for_its_router_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = build_moe_checkpoint(tmp_path / "moe", "qwen3_moe")
    batch = _batch(model_dir, seed=0)
    with _one_rank(model_dir, 2, router_balance_coef=0.01, router_z_coef=0.001) as rank:
        reads = _count_reads(rank, monkeypatch, lambda: rank.accumulate_gradients(batch))
    assert reads == {"trainer/policy.py": 1, "trainer/moe.py": 1, **_per_forward(3)}


def test_log_probs_read_the_device_once_for_the_result_and_once_per_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _batch(tiny_model_dir, seed=1)
    with _one_rank(tiny_model_dir, 2) as rank:
        reads = _count_reads(rank, monkeypatch, lambda: rank.compute_logprobs(batch))
    # The gathered [B, T-1] log-probs, copied to the host.
    assert reads == {"trainer/ranks.py": 1, **_per_forward(3)}
