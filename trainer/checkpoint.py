"""One FSDP2 role's training state on disk: sharded model and optimizer, schedule, RNG.
Only trained parameters are written: a LoRA run's checkpoint holds its adapters, not the base.

Tensors go through `torch.distributed.checkpoint` (each rank writes its own shards; a resume
may use another number of ranks). Nothing else is pickled: the schedule and RNG states are
JSON, and DCP's own metadata file, which it pickles, is read back by an unpickler that
admits only DCP's metadata classes. A checkpoint is refused before any shard is read when its
metadata declares a pickled (bytes) item, which DCP's load planner would unpickle with plain
pickle, or places a shard outside its directory, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.loss_scale import LossScale

# The classes DCP's .metadata pickle may name, and nothing else.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "_Checkpointable"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _SAFE_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}: refused")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader for checkpoints that may be hostile: the restricted metadata
    unpickler, then `_check_items` (tensor files are already read with
    torch.load(weights_only=True))."""

    def read_metadata(self, *args: object, **kwargs: object) -> dcp.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as e:
            raise ValueError(f"checkpoint metadata {path} is not valid DCP metadata: {e}") from e
        if not (
            isinstance(metadata, dcp.Metadata)
            and isinstance(getattr(metadata, "state_dict_metadata", None), dict)
            and isinstance(getattr(metadata, "storage_data", None), dict)
        ):
            raise ValueError(
                f"checkpoint metadata {path} is not valid DCP metadata: its table of keys or "
                "of shard files is missing"
            )
        _check_items(metadata, path)
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_items(metadata: dcp.Metadata, path: Path) -> None:
    """Refuse what `save_training_state` never writes but DCP would follow: a bytes item
    (DCP's load planner unpickles those with weights_only=False, so one that re-declares a
    weight runs whatever its pickle says) and a shard file outside the checkpoint."""
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(
                f"checkpoint metadata {path} declares {key} as {type(item).__name__}, not a "
                "tensor; checkpoints of this trainer hold only tensors, so it was altered or "
                "written by something else: refused"
            )
    root = path.parent.resolve()
    for index, info in metadata.storage_data.items():
        key = getattr(index, "fqn", index)
        where = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(where, str):
            raise ValueError(
                f"checkpoint metadata {path} is not valid DCP metadata: the entry of {key} "
                "names no shard file"
            )
        # resolve() follows `..` and symlinks, so both are caught where they lead.
        if not (root / where).resolve().is_relative_to(root):
            raise ValueError(
                f"checkpoint metadata {path} places {key} in {where}, outside {root}: refused"
            )


def load_shards(state: dict, directory: Path, no_dist: bool = False) -> None:
    """Fill `state` (nested dicts of tensors) from the DCP checkpoint in `directory`
    (collective unless `no_dist`); a refused checkpoint is a ValueError naming its metadata
    file and the key, raised before any shard is read."""
    reader = SafeReader(directory)
    # Also checked inside dcp.load, but a refusal there reaches the caller as a
    # CheckpointException that holds every rank's traceback.
    reader.read_metadata()
    dcp.load(state, storage_reader=reader, no_dist=no_dist)


# Frozen parameters (a LoRA run's base, model.frozen) never change: model.path holds them,
# and a resume checks that its weights are the ones the run started from (base_weights.py).
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
_LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Trained model tensors and their optimizer state by FQN; frozen parameters and the
    optimizer's hyperparameters stay out (they come from model.path and the config, and DCP
    would pickle the hyperparameters)."""
    return {
        "model": get_model_state_dict(model, options=_TRAINED_ONLY),
        "optim": get_optimizer_state_dict(model, optimizer)["state"],
    }


def _shapes(model_state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Full (global) shape of every tensor; what a resume checks the model against."""
    return {name: list(t.shape) for name, t in model_state.items()}


def save_training_state(
    directory: Path,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss_scale: LossScale | None = None,
) -> None:
    """Write this rank's shards (collective), and on rank 0 the schedule (with the fp16 loss
    scale) and the full tensor shapes; every rank writes its RNG state."""
    directory.mkdir(parents=True, exist_ok=True)
    state = _tensor_state(model, optimizer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)))
    if rank == 0:
        schedule = {
            "scheduler": scheduler.state_dict(),
            "lrs": [group["lr"] for group in optimizer.param_groups],
            "loss_scale": None if loss_scale is None else loss_scale.state_dict(),
        }
        (directory / "schedule.json").write_text(json.dumps(schedule))
        (directory / "shapes.json").write_text(json.dumps(_shapes(state["model"])))
    (directory / f"rng_rank{rank}.json").write_text(json.dumps(rng_state()))


def load_training_state(
    directory: Path,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss_scale: LossScale | None = None,
) -> None:
    """Restore what `save_training_state` wrote (collective); shapes that differ from the
    model's are a ValueError naming the checkpoint. `loss_scale` continues from the saved
    scale when the checkpoint has one (it was written by an fp16 run)."""
    state = _tensor_state(model, optimizer)
    saved = json.loads((directory / "shapes.json").read_text())
    current = _shapes(state["model"])
    if saved != current:
        different = sorted(
            n for n in saved.keys() | current.keys() if saved.get(n) != current.get(n)
        )
        raise ValueError(
            f"checkpoint {directory} holds a different model: {different[0]} is "
            f"{saved.get(different[0])} there and {current.get(different[0])} here; resume with "
            "the model.path the run started from"
        )
    load_shards(state, directory)
    set_model_state_dict(model, state["model"], options=_LOAD_TRAINED_ONLY)
    param_groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    set_optimizer_state_dict(
        model, optimizer, {"state": state["optim"], "param_groups": param_groups}
    )
    schedule = json.loads((directory / "schedule.json").read_text())
    scheduler.load_state_dict(schedule["scheduler"])
    for group, lr in zip(optimizer.param_groups, schedule["lrs"], strict=True):
        group["lr"] = lr
    if loss_scale is not None and schedule.get("loss_scale"):
        loss_scale.load_state_dict(schedule["loss_scale"])
    rng_file = directory / f"rng_rank{rank}.json"
    if rng_file.exists():  # absent when resuming on more ranks than were saved
        set_rng_state(json.loads(rng_file.read_text()))


def rng_state() -> dict:
    """Python, numpy and torch (CPU and CUDA) generator states, as JSON."""

    def encode(tensor: torch.Tensor) -> str:
        return base64.b64encode(tensor.numpy().tobytes()).decode()

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": encode(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(s) for s in state["cuda"]])
