"""A DCP checkpoint's metadata rewritten as whoever can write its directory could: a tensor
re-declared as a pickled (bytes) item, or its shards moved to another path."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

PAYLOAD = "payload.distcp"


class _TouchFile:
    """A pickle that creates `marker` when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def _read(directory: Path) -> Metadata:
    return pickle.loads((directory / ".metadata").read_bytes())  # the test's own file


def _write(directory: Path, metadata: Metadata) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def redeclare_as_pickle(directory: Path, key: str, marker: Path) -> None:
    """Make DCP key `key` (a tensor) a bytes item whose pickle creates `marker`."""
    payload = pickle.dumps(_TouchFile(marker))
    (directory / PAYLOAD).write_bytes(payload)
    metadata = _read(directory)
    assert key in metadata.state_dict_metadata, key
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(PAYLOAD, 0, len(payload))
    _write(directory, metadata)


def relocate_shards(directory: Path, key: str, prefix: str) -> None:
    """Prefix the shard file names of DCP key `key` with `prefix` (a directory path)."""
    metadata = _read(directory)
    moved = {
        index: _StorageInfo(prefix + info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
        if index.fqn == key
    }
    assert moved, key
    metadata.storage_data.update(moved)
    _write(directory, metadata)
