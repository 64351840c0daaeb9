"""Rank-local loading: each FSDP2 rank reads only its own rows of an HF checkpoint.

The model is built on the meta device (shapes, no storage) and sharded with `fully_shard`;
`to_empty` then gives each rank storage for its shards alone, which it fills from the
safetensors files. FSDP2 shards dimension 0, and a row-major tensor's rows are one contiguous
byte range, so a rank reads its rows with one seek and one read per tensor. A rank's peak host
memory at start-up is its shards plus one tensor's rows in the file's dtype, where loading the
checkpoint with `from_pretrained` on every rank held the whole model on each.

A mixture of experts holds each layer's experts fused, one dim-0 row per expert
(`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), where its checkpoint stores one
tensor per expert and projection. Which files' tensors make which fused row, and in which order,
is read off transformers' own conversion mapping for the model type (what `from_pretrained`
applies), so a rank reads only its own experts' tensors; a checkpoint that stores the fused
tensors themselves is read as any other.

What the files do not hold is made as `from_pretrained` makes it: the rotary embedding's
frequencies are computed on CPU from the config, and LoRA's first adapters are drawn by peft
itself from the run's seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from kernels.attention import ATTENTION, PACKED_ATTENTION, attention_layer_types
from rl.config import LoraConfig
from rl.config.safetensors_files import StoredTensor, checkpoint_tensors, read_rows

# What peft names its adapters' modules inside an adapted linear: they are not in the checkpoint.
LORA_ADAPTERS = (".lora_A.", ".lora_B.")
# At most this many bytes of a tensor are read (in the file's dtype) before they are copied.
READ_BYTES = 16 * 2**20


def meta_causal_lm(path: str) -> PreTrainedModel:
    """The HF causal LM of checkpoint directory `path`, fp32, on the meta device: its modules,
    names and tied weights as `from_pretrained` builds them, without storage. Its attention
    runs packed rows sample by sample without a mask (`kernels.attention.PACKED_ATTENTION`)
    unless a layer attends over a sliding window, which needs the masks of `ATTENTION`."""
    config = AutoConfig.from_pretrained(path)
    full = attention_layer_types(config) == {"full_attention"}
    implementation = PACKED_ATTENTION if full else ATTENTION
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=implementation
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


@dataclass(frozen=True)
class ExpertRows:
    """A tensor the model holds fused, one dim-0 row per expert, that the checkpoint stores per
    expert: row e is `parts[k][e]` for k in order (gate, then up), concatenated along `dim` of
    one expert's tensor."""

    parts: tuple[tuple[str, ...], ...]
    dim: int


@dataclass
class CheckpointNames:
    """Where the tensors a model names live in a checkpoint whose names transformers converts
    on loading: `renamed` (model name -> stored name), `experts` (model name -> the per-expert
    tensors of its rows), and `unreadable` (model name -> why its rows cannot be read)."""

    renamed: dict[str, str] = field(default_factory=dict)
    experts: dict[str, ExpertRows] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)


def _concat_dim(converter: WeightConverter) -> int | None:
    """The dim of one expert's tensor along which `converter` joins its sources into a fused
    row, when it stacks experts along dim 0 and does nothing else (then a row is its expert's
    tensors alone); None for any other conversion."""
    ops = converter.operations
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 0 if len(converter.source_patterns) == 1 else None
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        return ops[1].dim - 1
    return None


def checkpoint_names(model_type: str, stored: Iterable[str]) -> CheckpointNames:
    """The model names of `stored` (a checkpoint's tensor names) under transformers' conversion
    mapping for `model_type`, as `from_pretrained` renames and groups them: keys in natural
    order, renamings first, then at most one converter, whose sources stack in that order."""
    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    names = CheckpointNames()
    grouped: dict[str, dict[str, list[str]]] = {}
    converter_of: dict[str, WeightConverter] = {}
    for key in sorted(stored, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if target != key:
                names.renamed[target] = key
            continue
        grouped.setdefault(target, {}).setdefault(pattern, []).append(key)
        converter_of[target] = next(c for c in converters if pattern in c.source_patterns)
    for target, by_pattern in grouped.items():
        converter = converter_of[target]
        dim = _concat_dim(converter)
        parts = [tuple(by_pattern.get(pattern, ())) for pattern in converter.source_patterns]
        if dim is None:
            names.unreadable[target] = (
                f"transformers makes it from {converter.source_patterns} by "
                f"{converter.operations}, which is not a stack of whole experts"
            )
        elif len({len(part) for part in parts}) != 1:
            counts = {
                p: len(part) for p, part in zip(converter.source_patterns, parts, strict=True)
            }
            names.unreadable[target] = f"its per-expert tensors do not pair up: {counts}"
        else:
            names.experts[target] = ExpertRows(tuple(parts), dim)
    return names


def _copy_rows(
    dest: torch.Tensor,
    stored: StoredTensor,
    key: str,
    start: int,
    buffer: torch.Tensor,
) -> None:
    """Rows [start, start + len(dest)) of `stored` (named `key`) into `dest`, a bounded number
    at a time through `buffer` (uint8)."""
    if not dest.dim():
        dest.copy_(read_rows(stored, key, buffer=buffer))
        return
    # A bounded number of rows at a time, through one buffer: read whole, the embedding's
    # rows (an untied LM head's, read last) would add a shard of it to the peak.
    step = max(1, buffer.numel() // max(1, stored.row_bytes))
    stop = start + len(dest)
    for begin in range(start, stop, step):
        end = min(stop, begin + step)
        dest[begin - start : end - start].copy_(read_rows(stored, key, (begin, end), buffer))


def _expert_shape(
    rows: ExpertRows, stored: dict[str, StoredTensor], key: str, path: str
) -> tuple[int, ...]:
    """The fused shape the per-expert tensors of `rows` make; ValueError naming the directory
    and `key` when they do not fit together."""
    shapes = []
    for part in rows.parts:
        part_shapes = {stored[name].shape for name in part}
        if len(part_shapes) != 1:
            raise ValueError(
                f"model directory {path}: the per-expert tensors of {key!r} ({part[0]!r}, ...) "
                f"differ in shape: {sorted(map(list, part_shapes))}"
            )
        shapes.append(part_shapes.pop())
    first = shapes[0]
    if any(
        len(s) != len(first)
        or len(s) <= rows.dim
        or s[: rows.dim] != first[: rows.dim]
        or s[rows.dim + 1 :] != first[rows.dim + 1 :]
        for s in shapes
    ):
        raise ValueError(
            f"model directory {path}: the per-expert tensors of {key!r} cannot be joined "
            f"along dim {rows.dim}: shapes {[list(s) for s in shapes]}"
        )
    joined = (*first[: rows.dim], sum(s[rows.dim] for s in shapes), *first[rows.dim + 1 :])
    return (len(rows.parts[0]), *joined)


def _copy_expert_rows(
    dest: torch.Tensor,
    rows: ExpertRows,
    stored: dict[str, StoredTensor],
    start: int,
    buffer: torch.Tensor,
) -> None:
    """Experts [start, start + len(dest)) of `rows` into `dest`, each from its own tensors."""
    for expert in range(start, start + len(dest)):
        offset = 0
        for part in rows.parts:
            key = part[expert]
            size = stored[key].shape[rows.dim]
            _copy_rows(
                dest[expert - start].narrow(rows.dim, offset, size), stored[key], key, 0, buffer
            )
            offset += size


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

    A peft-wrapped linear keeps the base weight as `base_layer.weight` (a wrapped parameter, as
    `base_layer.<name>`): the checkpoint names it without `base_layer`. Names containing one of
    `skip` (LoRA's adapters) are not read.
    Rows are read at most `read_bytes` (in the file's dtype) at a time. A tensor the checkpoint
    stores per expert (`checkpoint_names`) is read expert row by expert row from its experts'
    tensors.
    ValueError naming the directory and the tensor when the checkpoint lacks it, holds it in
    another shape, or makes it by a conversion that is not a stack of whole experts.
    """
    stored = checkpoint_tensors(Path(path))
    names = checkpoint_names(AutoConfig.from_pretrained(path).model_type, stored)
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
        # peft nests a wrapper per adapted parameter (two around fused experts).
        key = prefix + ".".join(part for part in name.split(".") if part != "base_layer")
        experts = None
        if key not in stored:  # stored under another name, or per expert
            if key in names.unreadable:
                raise ValueError(
                    f"model directory {path}: tensor {key!r} cannot be read rank by rank: "
                    f"{names.unreadable[key]}"
                )
            experts = names.experts.get(key)
            key = names.renamed.get(key, key)
            if experts is None and key not in stored:
                raise ValueError(
                    f"model directory {path}: its safetensors files hold no tensor {key!r}"
                )
        shape = stored[key].shape if experts is None else _expert_shape(experts, stored, key, path)
        if shape != tuple(tensor.shape):
            raise ValueError(
                f"model directory {path}: tensor {key!r} has shape {list(shape)}, "
                f"but its config.json makes it {list(tensor.shape)}"
            )
        local, rows = _rows(tensor)
        start = 0 if rows is None else rows[0]
        if experts is None:
            _copy_rows(local, stored[key], key, start, buffer)
        else:
            _copy_expert_rows(local, experts, stored, start, buffer)


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
        for name, param in list(module.named_parameters(recurse=False)):
            # peft puts an adapter where its base weight is (a linear's, or a wrapped
            # parameter's such as fused experts): on CPU, here at no cost (one element,
            # broadcast to the weight's shape).
            stand_in = torch.empty((), dtype=param.dtype).expand(param.shape)
            setattr(module, name, nn.Parameter(stand_in, requires_grad=False))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drawn = get_peft_model(twin, cfg.peft_config())
    params = dict(model.named_parameters())
    for name, adapter in drawn.named_parameters():
        if any(part in name for part in LORA_ADAPTERS):
            local, rows = _rows(params[name])
            local.copy_(adapter if rows is None else adapter[rows[0] : rows[1]])
