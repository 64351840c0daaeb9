"""The weight-sync transfer plan: which rows and columns go from which trainer rank to which
rollout tensor-parallel rank, bucket by bucket. Pure: no torch.distributed, no vLLM.

Trainer layout: FSDP2 shards every parameter along dim 0 over W ranks the way `torch.chunk`
does (chunks of ceil(n / W) rows; trailing ranks may hold fewer rows or none).

Rollout layout: vLLM's tensor parallelism over T ranks, in Hugging Face names. Column-parallel
projections (q/k/v, gate/up) split dim 0; row-parallel ones (o_proj, down_proj) split dim 1;
the vocabulary-parallel embedding and LM head split the vocabulary padded to a multiple of 64;
k/v heads are replicated when there are fewer of them than ranks; everything else (norms,
row-parallel biases, a mixture of experts' router) is needed whole. With T = 1 every rank needs
every tensor whole.

A mixture of experts' fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], sharded by expert in the trainer) are needed whole too: vLLM's TP rank keeps a
slice of every expert's intermediate dimension (rows of both the gate and the up half, columns
of down_proj), which is no one block of rows and columns of the tensor seen as 2-D. vLLM's
expert loader cuts its slice out of the whole tensor.

A bucket travels as one flat buffer holding its tensors whole, one after another: every
trainer rank writes its own rows in place, and every rollout rank reads only its region. The
buffer's dtype is the plan's `wire_dtype`: the engines' dtype (`model.dtype`), into which
vLLM's loaders would cast fp32 weights anyway (the same rounding), so that a bf16 run moves
half the bytes of fp32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# vLLM pads the vocabulary to this multiple before splitting it (DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64
# The dtypes weights can travel in (model.dtype's choices), and their bytes per element.
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_COLUMN_PARALLEL = ("q_proj", "gate_proj", "up_proj")
_KV_PROJECTIONS = ("k_proj", "v_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")
# HF projections vLLM fuses into one layer (and so loads together).
_FUSED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


@dataclass(frozen=True)
class TensorSpec:
    """One trained tensor in HF naming; `shape` is the full (unsharded) shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def num_cols(self) -> int:
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class AttentionShape:
    """What vLLM's tensor-parallel slicing depends on, read off the HF config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class Region:
    """Rows [row_start, row_stop) x columns [col_start, col_stop) of a tensor seen as 2-D
    [shape[0], prod(shape[1:])] (a 1-D tensor has one column)."""

    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    @property
    def numel(self) -> int:
        return max(self.row_stop - self.row_start, 0) * max(self.col_stop - self.col_start, 0)


def owned_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The dim-0 rows FSDP2 gives `rank`: torch.chunk's split into `world_size` pieces."""
    chunk = math.ceil(num_rows / world_size)
    return min(rank * chunk, num_rows), min((rank + 1) * chunk, num_rows)


def _split(size: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{what} of size {size} does not split evenly over {parts} TP ranks")
    step = size // parts
    return index * step, (index + 1) * step


def needed_region(spec: TensorSpec, shape: AttentionShape, tp_rank: int, tp_size: int) -> Region:
    """The part of `spec` that vLLM's rank `tp_rank` of `tp_size` loads."""
    whole = Region(0, spec.num_rows, 0, spec.num_cols)
    if tp_size == 1 or len(spec.shape) == 3:  # 3-D: fused experts (module docstring)
        return whole
    parts = spec.name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    leaf = parts[-1]
    if module in _COLUMN_PARALLEL:
        return Region(*_split(spec.num_rows, tp_size, tp_rank, spec.name), 0, spec.num_cols)
    if module in _KV_PROJECTIONS:
        if shape.num_kv_heads >= tp_size:
            rows = _split(spec.num_rows, tp_size, tp_rank, spec.name)
        else:  # fewer kv heads than ranks: vLLM replicates each over tp_size // num_kv_heads
            head = tp_rank // (tp_size // shape.num_kv_heads)
            rows = (head * shape.head_dim, (head + 1) * shape.head_dim)
        return Region(*rows, 0, spec.num_cols)
    if module in _ROW_PARALLEL and leaf == "weight":
        return Region(0, spec.num_rows, *_split(spec.num_cols, tp_size, tp_rank, spec.name))
    if module in _VOCAB_PARALLEL:
        padded = math.ceil(shape.vocab_size / VOCAB_PADDING) * VOCAB_PADDING
        per_rank = padded // tp_size
        start = min(tp_rank * per_rank, spec.num_rows)
        return Region(start, min(start + per_rank, spec.num_rows), 0, spec.num_cols)
    return whole


def load_unit(name: str) -> str:
    """The vLLM layer `name` loads into: tensors of one unit must travel in one bucket."""
    module, _, _ = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    fused = _FUSED_INTO.get(last, last)
    return f"{parent}.{fused}" if parent else fused


@dataclass(frozen=True)
class WeightSyncPlan:
    """Buckets of whole load units (each at most `bucket_bytes` of full tensors in
    `wire_dtype`, unless one unit alone is larger), for W trainer ranks and rollout engines of
    T ranks each."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[TensorSpec, ...], ...]
    shape: AttentionShape
    world_size: int
    tp_size: int
    wire_dtype: str

    @property
    def bytes_per_element(self) -> int:
        return WIRE_BYTES[self.wire_dtype]

    def offsets(self, bucket: int) -> list[int]:
        """Where each tensor of `bucket` starts in the bucket's buffer, in elements."""
        out, offset = [], 0
        for spec in self.buckets[bucket]:
            out.append(offset)
            offset += spec.num_rows * spec.num_cols
        return out

    @property
    def slot_numel(self) -> int:
        """Elements of the largest bucket: the size of each transport buffer."""
        return max(sum(s.num_rows * s.num_cols for s in bucket) for bucket in self.buckets)

    def region(self, spec: TensorSpec, tp_rank: int) -> Region:
        """The part of `spec` rollout rank `tp_rank` loads (`needed_region`)."""
        return needed_region(spec, self.shape, tp_rank, self.tp_size)

    def bucket_bytes_to_rank(self, bucket: int, tp_rank: int) -> int:
        """Bytes rollout rank `tp_rank` loads of `bucket`."""
        return self.bytes_per_element * sum(
            self.region(spec, tp_rank).numel for spec in self.buckets[bucket]
        )

    def bytes_to_rank(self, tp_rank: int) -> int:
        """Bytes one rollout rank loads per sync."""
        return sum(self.bucket_bytes_to_rank(b, tp_rank) for b in range(len(self.buckets)))

    @property
    def total_bytes(self) -> int:
        """Bytes of the full tensors: what each rank would receive without slicing."""
        return self.bytes_per_element * sum(s.num_rows * s.num_cols for s in self.tensors)


def plan_weight_sync(
    tensors: list[TensorSpec],
    shape: AttentionShape,
    world_size: int,
    tp_size: int,
    bucket_bytes: int,
    wire_dtype: str,
) -> WeightSyncPlan:
    """Group `tensors` (model order, tied names deduplicated) into buckets of whole load units
    of at most `bucket_bytes` in `wire_dtype`."""
    assert wire_dtype in WIRE_BYTES, wire_dtype
    if world_size < 1 or tp_size < 1:
        raise ValueError(f"world_size={world_size} and tp_size={tp_size} must be >= 1")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    if not tensors:
        raise ValueError("nothing to sync: every parameter is frozen (model.frozen)")
    units: dict[str, list[TensorSpec]] = {}
    for spec in tensors:
        units.setdefault(load_unit(spec.name), []).append(spec)
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    size = 0
    for unit in units.values():
        unit_bytes = WIRE_BYTES[wire_dtype] * sum(s.num_rows * s.num_cols for s in unit)
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.extend(unit)
        size += unit_bytes
    if current:
        buckets.append(tuple(current))
    return WeightSyncPlan(tuple(tensors), tuple(buckets), shape, world_size, tp_size, wire_dtype)


def plan_to_json(plan: WeightSyncPlan) -> str:
    """A plain-JSON form of `plan` (it crosses vLLM's RPC serialisation to worker processes)."""
    return json.dumps(
        {
            "tensors": [[spec.name, list(spec.shape)] for spec in plan.tensors],
            "bucket_sizes": [len(bucket) for bucket in plan.buckets],
            "shape": [
                plan.shape.num_heads,
                plan.shape.num_kv_heads,
                plan.shape.head_dim,
                plan.shape.vocab_size,
            ],
            "world_size": plan.world_size,
            "tp_size": plan.tp_size,
            "wire_dtype": plan.wire_dtype,
        }
    )


def plan_from_json(text: str) -> WeightSyncPlan:
    data = json.loads(text)
    tensors = tuple(TensorSpec(name, tuple(shape)) for name, shape in data["tensors"])
    buckets, start = [], 0
    for size in data["bucket_sizes"]:
        buckets.append(tensors[start : start + size])
        start += size
    assert start == len(tensors)
    return WeightSyncPlan(
        tensors,
        tuple(buckets),
        AttentionShape(*data["shape"]),
        data["world_size"],
        data["tp_size"],
        data["wire_dtype"],
    )
