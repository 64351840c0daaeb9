"""Rank-local loading: each FSDP2 rank reads only its own rows of an HF checkpoint.

The model is built on the meta device (shapes, no storage) and sharded with `fully_shard`;
`to_empty` then gives each rank storage for its shards alone, which it fills from the
safetensors files. FSDP2 shards dimension 0, and a row-major tensor's rows are one contiguous
byte range, so a rank reads its rows with one seek and one read per tensor. A rank's peak host
memory at start-up is its shards plus one tensor's rows in the file's dtype, where loading the
checkpoint with `from_pretrained` on every rank held the whole model on each.

What the files do not hold is made as `from_pretrained` makes it: the rotary embedding's
frequencies are computed on CPU from the config, and LoRA's first adapters are drawn by peft
itself from the run's seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kernels.attention import ATTENTION
from rl.config import LoraConfig
from rl.config.safetensors_files import checkpoint_tensors, read_rows

# What peft names its adapters' modules inside an adapted linear: they are not in the checkpoint.
LORA_ADAPTERS = (".lora_A.", ".lora_B.")
# At most this many bytes of a tensor are read (in the file's dtype) before they are copied.
READ_BYTES = 16 * 2**20


def meta_causal_lm(path: str) -> PreTrainedModel:
    """The HF causal LM of checkpoint directory `path`, fp32, on the meta device: its modules,
    names and tied weights as `from_pretrained` builds them, without storage."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=ATTENTION
        )
    return model


def meta_lora(model: PreTrainedModel, cfg: LoraConfig) -> nn.Module:
    """`model` (on meta) with peft's LoRA adapters on `cfg.target_modules`, on meta too
    (`low_cpu_mem_usage`): `init_lora_adapters` gives them their first values once sharded."""
    from peft import get_peft_model

    return get_peft_model(model, cfg.peft_config(), low_cpu_mem_usage=True)


def _rows(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """(this rank's storage of `param`, its rows of dimension 0; None: all of it)."""
    if not isinstance(param, DTensor):
        return param.data, None
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    assert tuple(shape[1:]) == tuple(param.shape[1:]) and not any(offset[1:]), (
        "FSDP2 shards dimension 0 only"
    )
    start = offset[0] if shape else 0
    return param.to_local(), (start, start + (shape[0] if shape else 1))


@torch.no_grad()
def load_local_rows(
    module: nn.Module,
    path: str,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    read_bytes: int = READ_BYTES,
) -> None:
    """Fill every parameter and persistent buffer of `module` (sharded, after `to_empty`) with
    this rank's rows of the tensor named `prefix` + its name in the checkpoint at `path`.

    A peft-wrapped linear keeps the base weight as `base_layer.weight`: the checkpoint names it
    without `base_layer`. Names containing one of `skip` (LoRA's adapters) are not read.
    Rows are read at most `read_bytes` (in the file's dtype) at a time.
    ValueError naming the directory and the tensor when the checkpoint lacks it or holds it
    in another shape.
    """
    stored = checkpoint_tensors(Path(path))
    buffer = torch.empty(read_bytes, dtype=torch.uint8)
    persistent = [
        (f"{owner}.{name}" if owner else name, buffer)
        for owner, sub in module.named_modules()
        for name, buffer in sub.named_buffers(recurse=False)
        if name not in sub._non_persistent_buffers_set
    ]
    for name, tensor in [*module.named_parameters(), *persistent]:
        if any(s in name for s in skip):
            continue
        key = prefix + name.replace(".base_layer.", ".")
        if key not in stored:
            raise ValueError(
                f"model directory {path}: its safetensors files hold no tensor {key!r}"
            )
        if stored[key].shape != tuple(tensor.shape):
            raise ValueError(
                f"model directory {path}: tensor {key!r} has shape {list(stored[key].shape)}, "
                f"but its config.json makes it {list(tensor.shape)}"
            )
        local, rows = _rows(tensor)
        if not local.dim():
            local.copy_(read_rows(stored[key], key, buffer=buffer))
            continue
        start, stop = rows if rows is not None else (0, len(local))
        # A bounded number of rows at a time, through one buffer: read whole, the embedding's
        # rows (an untied LM head's, read last) would add a shard of it to the peak.
        step = max(1, read_bytes // max(1, stored[key].row_bytes))
        for begin in range(start, stop, step):
            end = min(stop, begin + step)
            rows_read = read_rows(stored[key], key, (begin, end), buffer)
            local[begin - start : end - start].copy_(rows_read)


@torch.no_grad()
def restore_computed_buffers(model: nn.Module) -> None:
    """The non-persistent buffers (rotary frequencies), which `to_empty` left uninitialised:
    each owning module is built again on CPU from its config, as `from_pretrained` builds it,
    and its buffers copied over. ValueError for a module that cannot be rebuilt so."""
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(
                f"{type(module).__name__} ({name}) has buffers computed at construction "
                f"({sorted(module._non_persistent_buffers_set)}) and no config to compute them "
                "from: this model cannot be loaded rank by rank"
            )
        fresh = type(module)(config)
        for buffer in module._non_persistent_buffers_set:
            getattr(module, buffer).copy_(getattr(fresh, buffer))


def materialize(
    root: nn.Module,
    model: nn.Module,
    path: str,
    device: str,
    prefix: str = "",
    skip: tuple[str, ...] = (),
) -> None:
    """Give `root` (sharded, on meta) storage for this rank's shards on `device`, then fill
    `model`, the part of it the checkpoint at `path` holds, from the files
    (`load_local_rows` with `prefix` and `skip`) and from its config
    (`restore_computed_buffers`). What else `root` holds is left for the caller to set."""
    root.to_empty(device=device)
    load_local_rows(model, path, prefix=prefix, skip=skip)
    restore_computed_buffers(model)


@torch.no_grad()
def init_lora_adapters(model: nn.Module, path: str, cfg: LoraConfig, seed: int) -> None:
    """The first adapters of `model` (`meta_lora` of checkpoint `path`'s model, sharded and
    given storage), as `get_peft_model` draws them on CPU after `torch.manual_seed(seed)`:
    peft itself draws them, over a copy of the model built on meta, and each rank copies out
    its rows (the full adapters are small)."""
    from peft import get_peft_model

    twin = meta_causal_lm(path)
    for module in twin.modules():
        if isinstance(module, nn.Linear):
            # peft puts an adapter where its base weight is: on CPU, here at no cost (one
            # element, broadcast to the weight's shape).
            stand_in = torch.empty((), dtype=module.weight.dtype).expand(module.weight.shape)
            module.weight = nn.Parameter(stand_in, requires_grad=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drawn = get_peft_model(twin, cfg.peft_config())
    params = dict(model.named_parameters())
    for name, adapter in drawn.named_parameters():
        if any(part in name for part in LORA_ADAPTERS):
            local, rows = _rows(params[name])
            local.copy_(adapter if rows is None else adapter[rows[0] : rows[1]])
