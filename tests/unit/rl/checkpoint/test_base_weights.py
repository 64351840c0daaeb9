"""The base's weight hashes: a start whose files are unchanged reads only their heads, a
changed file is hashed again, and the record of hashed files is read as untrusted input."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rl.checkpoint import base_weights
from tests.helpers.repo import REPO

DATA_BYTES = 4 * 2**20

# One `rl train` start's hashing in a fresh process, with the bytes it read (/proc/self/io's
# rchar, every thread's read syscalls) around the call only. The racy window (a file hashed
# within it of its last change is not remembered) is set to 0: the test's files are seconds
# old, and a window in the real seconds would only make the test wait.
_START = """
import json, sys
from pathlib import Path
from rl.checkpoint import base_weights

def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

base_weights._RACY_NS = 0
before = rchar()
hashes = base_weights.weight_hashes(Path(sys.argv[1]))
read = rchar() - before
print(json.dumps({"hashes": hashes, "read": read}))
"""


def _write_safetensors(path: Path, data: bytes) -> None:
    """A one-tensor safetensors file (u8 [len(data)]), written by hand so the test knows every
    byte: 8-byte header length, JSON header, data."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    raw = header.encode().ljust(-(-len(header) // 8) * 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _base(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for i in range(2):
        _write_safetensors(
            model / f"model-0000{i + 1}-of-00002.safetensors", os.urandom(DATA_BYTES)
        )
    (model / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (model / "config.json").write_text("{}")  # not a weight file: never hashed
    return model


def _sha256s(model: Path) -> dict[str, str]:
    """The expected hashes, from hashlib over each weight file's bytes."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in model.iterdir()
        if p.name.endswith((".safetensors", ".index.json"))
    }


def _start(model: Path, cache: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", _START, str(model)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def test_a_second_start_on_an_unchanged_base_reads_only_the_file_heads(tmp_path: Path) -> None:
    model, cache = _base(tmp_path), tmp_path / "cache"
    first = _start(model, cache)
    assert first["hashes"] == _sha256s(model)
    assert first["read"] >= 2 * DATA_BYTES  # every byte, once

    second = _start(model, cache)
    assert second["hashes"] == first["hashes"]
    # The record and each file's 8-byte length and JSON header: well under one file's data.
    assert second["read"] < DATA_BYTES / 16
    record = cache / "tandem" / "base_weight_hashes.json"
    assert record.stat().st_mode & 0o777 == 0o600  # the user's alone


def test_a_file_rewritten_in_place_with_its_size_and_mtime_kept_is_hashed_again(
    tmp_path: Path,
) -> None:
    model, cache = _base(tmp_path), tmp_path / "cache"
    first = _start(model, cache)
    shard = model / "model-00001-of-00002.safetensors"
    before = shard.stat()
    # New data bytes under the same header, same inode and size, and the old mtime put back:
    # only the change time (which no unprivileged call sets) shows it.
    with shard.open("r+b") as f:
        f.seek(-DATA_BYTES, os.SEEK_END)
        f.write(os.urandom(DATA_BYTES))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )

    second = _start(model, cache)
    assert second["hashes"] == _sha256s(model) != first["hashes"]
    assert DATA_BYTES <= second["read"] < 2 * DATA_BYTES  # the changed shard only


@pytest.fixture
def fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as a new start would be (nothing hashed yet, no warning given), with its
    record under tmp_path; returns the record's path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(base_weights, "_remembered", {})
    monkeypatch.setattr(base_weights, "_warned", set())
    monkeypatch.setattr(base_weights, "_RACY_NS", 0)  # as in _START
    return tmp_path / "cache" / "tandem" / "base_weight_hashes.json"


def _forge(record: Path, model: Path) -> None:
    """Make every entry of `record` vouch for another sha256 of its unchanged file."""
    data = json.loads(record.read_text())
    for entry in data["files"].values():
        entry["sha256"] = hashlib.sha256(b"forged").hexdigest()
    record.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda record, model: record.write_text('{"version": 1, "files": {'), "not JSON"),
        (
            lambda record, model: record.write_text(
                json.dumps({"version": 1, "files": {str(model / "x"): {"sha256": 1}}})
            ),
            "malformed entry",
        ),
        (
            lambda record, model: (_forge(record, model), record.chmod(0o666)),
            "writable by other users",
        ),
        (
            lambda record, model: (
                _forge(record, model),
                record.rename(record.with_name("elsewhere.json")),
                record.symlink_to("elsewhere.json"),
            ),
            "symbolic links",
        ),
    ],
    ids=["bad-json", "malformed-entry", "forged-and-world-writable", "symlink"],
)
def test_a_record_this_user_did_not_write_as_is_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path,
    fresh_process: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    damage,
    problem: str,
) -> None:
    model, record = _base(tmp_path), fresh_process
    expected = _sha256s(model)
    assert base_weights.weight_hashes(model) == expected
    damage(record, model)
    monkeypatch.setattr(base_weights, "_remembered", {})  # the next start
    hashed = []
    monkeypatch.setattr(
        base_weights, "sha256_files", lambda paths: hashed.extend(paths) or _real(paths)
    )

    assert base_weights.weight_hashes(model) == expected
    assert len(hashed) == len(expected)  # every file read in full
    err = capsys.readouterr().err
    assert f"warning: ignoring {record}" in err and problem in err
    # Replaced by a record of this start's hashes, which the next start trusts.
    assert not record.is_symlink() and record.stat().st_mode & 0o777 == 0o600
    monkeypatch.setattr(base_weights, "_remembered", {})
    hashed.clear()
    assert base_weights.weight_hashes(model) == expected and hashed == []


def _real(paths: list[Path]) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_a_file_changed_just_before_its_hashing_is_not_remembered(
    tmp_path: Path, fresh_process: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change in the same timestamp tick as the read would keep the stat the record holds:
    within the racy window of its last change, a file's hash is not written down."""
    model, record = _base(tmp_path), fresh_process
    monkeypatch.setattr(base_weights, "_RACY_NS", 3600 * 10**9)  # every file is that recent
    assert base_weights.weight_hashes(model) == _sha256s(model)
    assert not record.exists()
    monkeypatch.setattr(base_weights, "_remembered", {})
    hashed = []
    monkeypatch.setattr(
        base_weights, "sha256_files", lambda paths: hashed.extend(paths) or _real(paths)
    )
    assert base_weights.weight_hashes(model) == _sha256s(model)
    assert len(hashed) == 3  # the two shards and the index, read in full again
