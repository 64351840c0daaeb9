"""The tensors of an HF checkpoint directory's safetensors files, read from their JSON headers
(no pickle, no code) and, for the trainer's rank-local loading, row range by row range.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and [begin, end) byte offsets in the data that follows, then the data,
row-major. A model directory is untrusted: a header that is too long, not JSON, or whose
offsets do not fit the file or the shape is refused naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A header larger than this is not a model's (Qwen2.5-72B's largest is well under a megabyte).
_MAX_HEADER_BYTES = 100 * 2**20
# safetensors dtype -> (torch dtype's name, bytes per element). Names, so that the recipe checks,
# which read headers only, run without importing torch.
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, dtype and shape, and its bytes' absolute offsets."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of dimension 0 (of the whole tensor if it has no dimension)."""
        return math.prod(self.shape[1:]) * DTYPES[self.dtype][1]


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Tensor name -> StoredTensor for one safetensors file; ValueError naming the file and the
    tensor when the header does not describe tensors that fit in it."""
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file}: safetensors header length {length} does not fit the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"{file}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: safetensors header is not a JSON object")
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                entry["dtype"],
                tuple(entry["shape"]),
                entry["data_offsets"],
            )
            assert all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
        except (TypeError, KeyError, ValueError, AssertionError):
            raise ValueError(
                f"{file}: tensor {name!r} has no valid dtype, shape and data_offsets"
            ) from None
        if dtype not in DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {dtype}, not one of {sorted(DTYPES)}"
            )
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != nbytes or data_start + end > size:
            raise ValueError(
                f"{file}: tensor {name!r} of shape {list(shape)} ({dtype}) does not fit its "
                f"data_offsets [{begin}, {end}) in a file of {size} bytes"
            )
        tensors[name] = StoredTensor(file, dtype, shape, data_start + begin, data_start + end)
    return tensors


def checkpoint_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors files at the top of `model_dir`, by name."""
    tensors: dict[str, StoredTensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors |= read_header(file)
    return tensors


def read_rows(
    stored: StoredTensor,
    name: str,
    rows: tuple[int, int] | None = None,
    buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [start, stop) of dimension 0 of `stored` (all of it when `rows` is None), in its
    own dtype; `name` names it in errors. Read into the front of `buffer` (uint8) where it is
    large enough, so that a caller reading piece by piece allocates once; the result is then
    a view of it, valid until the next read.

    Row-major rows are one contiguous byte range: one seek and one read, into memory this
    process owns. The file is not mapped, so its pages never count as the process's memory.
    """
    import torch

    start, stop = rows if rows is not None else (0, stored.shape[0] if stored.shape else 1)
    assert 0 <= start <= stop <= (stored.shape[0] if stored.shape else 1), (name, rows)
    shape = (stop - start, *stored.shape[1:]) if stored.shape else ()
    nbytes = (stop - start) * stored.row_bytes
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    raw = buffer[:nbytes]
    if nbytes:
        with stored.file.open("rb") as f:
            f.seek(stored.begin + start * stored.row_bytes)
            if f.readinto(raw.numpy()) != nbytes:
                raise ValueError(f"{stored.file}: tensor {name!r} is cut short")
    return raw.view(getattr(torch, DTYPES[stored.dtype][0])).reshape(shape)
