"""Reading safetensors files without mapping them: rows as safetensors' own loader gives them,
and headers that do not describe the file refused naming it and the tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.config.safetensors_files import checkpoint_tensors, read_header, read_rows


def test_rows_equal_what_safetensors_loads_in_every_dtype_and_range(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(7, 5, generator=gen).bfloat16(),
        "f32": torch.randn(6, 3, 2, generator=gen),
        "f16": torch.randn(5, generator=gen).half(),
        "scalar": torch.tensor(3.5),
    }
    save_file(tensors, tmp_path / "a.safetensors")
    save_file({"i64": torch.arange(4)}, tmp_path / "b.safetensors")
    want = load_file(tmp_path / "a.safetensors") | load_file(tmp_path / "b.safetensors")
    stored = checkpoint_tensors(tmp_path)
    assert stored.keys() == want.keys()
    for name, tensor in want.items():
        got = read_rows(stored[name], name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        if tensor.dim():
            for start, stop in [(0, 1), (1, tensor.shape[0]), (2, 2)]:
                assert torch.equal(read_rows(stored[name], name, (start, stop)), tensor[start:stop])
                # Through a caller's buffer, where it is large enough: a view of it.
                buffer = torch.empty(64, dtype=torch.uint8)
                got = read_rows(stored[name], name, (start, stop), buffer)
                assert torch.equal(got, tensor[start:stop])
                fits = got.numel() * got.element_size() <= buffer.numel()
                assert (got.untyped_storage().data_ptr() == buffer.data_ptr()) == fits


def _raw_file(path: Path, header: object, data: bytes = b"\0" * 16) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"w": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}},
            "'w' of shape .* does not fit",
        ),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}},
            "'w' of shape .* does not fit",
        ),
        (
            {"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}},
            "'w' has dtype F8_E4M3",
        ),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "'w' has no valid"),
        ({"w": {"shape": [1]}}, "'w' has no valid"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_header_that_does_not_describe_the_file_is_refused_naming_both(
    tmp_path: Path, header: object, message: str
) -> None:
    path = _raw_file(tmp_path / "model.safetensors", header)
    with pytest.raises(ValueError, match=message) as caught:
        read_header(path)
    assert str(path) in str(caught.value)


def test_a_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="header length 1000000000 does not fit"):
        read_header(path)
