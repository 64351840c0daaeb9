"""The base model's weights as a checkpoint records them, so a resume can tell a changed base.

A checkpoint's shards hold the trained policy (and critic), but a resumed run reloads the
frozen reference and the frozen parameters (`model.frozen`) from `model.path`. Every
checkpoint therefore records the sha256 of each of the base's weight files (`BASE_WEIGHTS`),
and a resume refuses a model.path whose weight files differ in any byte.

Hashing reads every weight file (145 GB for a 72B base in bf16), so a file is hashed in full
only when it is new to this user: the record `record_file()` (in the user's cache directory)
keeps each hashed file's sha256 with what identifies its bytes without reading them, its
inode, size, modification and change times (ns) and the sha256 of its head (a safetensors
file's header: every tensor's name, dtype, shape and offsets); a start whose files all match
reads only their heads. What a match trusts, and what it cannot see, is in README.md
("Checkpoints, resume and faults"). Files that are hashed are hashed several at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import sys
import time
import uuid
from pathlib import Path

from rl.checkpoint.store import CheckpointError, sha256_files

BASE_WEIGHTS = "base_weights.json"
# Files of an HF model directory that hold its weights or say which file holds a tensor.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

# A file modified this close to its hashing could change again without its stat showing it
# (timestamps are coarse: git's "racily clean" entries); such hashes are not remembered.
_RACY_NS = 3_000_000_000
# A file's head is its first 8 + N bytes where the first 8 read as a length N that fits (a
# safetensors file's header length and header: judged by content, as an HF cache's blobs have
# no suffix), else its first MiB. A longer "header" is no model's (a forged length could make
# it the whole file).
_HEAD_BYTES = 2**20
_MAX_HEADER = 100 * 2**20
# The record is read as untrusted input: larger than this, it is not one Tandem wrote.
_MAX_RECORD_BYTES = 64 * 2**20
_RECORD_VERSION = 1
_INT_FIELDS = ("inode", "size", "mtime_ns", "ctime_ns")
_HEX_FIELDS = ("head_sha256", "sha256")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Entries this process hashed (resolved path -> entry), so that the CLI's check, the driver's
# record and its fault restarts share one pass even where the record cannot be written.
_remembered: dict[str, dict] = {}
# Warnings already given (the CLI and the driver both check).
_warned: set[str] = set()


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


def record_file() -> Path:
    """The record of hashed weight files: `$XDG_CACHE_HOME/tandem/` (`~/.cache/tandem/` when
    that is unset or relative, as the XDG spec says)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return root / "tandem" / "base_weight_hashes.json"


def weight_hashes(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} of the weight files at the top of HF model `model_dir` (where
    transformers loads them from); a file whose identity the record holds is not read again."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and is_weight_file(p.name))
    known = _read_record(record_file())
    hashes: dict[str, str] = {}
    unknown: list[tuple[Path, str, dict]] = []
    for path in files:
        key = str(path.resolve())
        identity = _identity(Path(key))
        for entry in (_remembered.get(key), known.get(key)):
            if entry is not None and all(entry[f] == identity[f] for f in identity):
                hashes[path.name] = entry["sha256"]
                break
        else:
            unknown.append((path, key, identity))
    started = time.time_ns()
    digests = sha256_files([Path(key) for _, key, _ in unknown])
    fresh = {}
    for (path, key, identity), digest in zip(unknown, digests, strict=True):
        hashes[path.name] = digest
        # Remembered only if the file did not change while it was read, and not so recently
        # that a change in the same timestamp tick would go unseen.
        settled = max(identity["mtime_ns"], identity["ctime_ns"]) < started - _RACY_NS
        if settled and _identity(Path(key)) == identity:
            fresh[key] = {**identity, "sha256": digest}
    if fresh:
        _remembered.update(fresh)
        _write_record(record_file(), {**known, **fresh})
    return hashes


def _identity(path: Path) -> dict:
    """What identifies `path`'s bytes without reading them all (the record's fields but the
    sha256)."""
    st = path.stat()
    with path.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if 0 <= length <= min(st.st_size - 8, _MAX_HEADER):
            head += f.read(length)
        else:
            head += f.read(_HEAD_BYTES - len(head))
    return {
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "head_sha256": hashlib.sha256(head).hexdigest(),
    }


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)


def _read_record(path: Path) -> dict[str, dict]:
    """The record's entries; {} with a warning when it is not one this user wrote in this
    format (another owner, writable by others, too large, not JSON, a malformed entry):
    the files are then hashed in full and the record written afresh."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as e:  # a symlink (ELOOP) or unreadable
        _warn(f"ignoring {path} ({e.strerror}); the base's weight files are hashed in full")
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"owned by uid {st.st_uid}, not by this user"
        elif st.st_mode & 0o022:
            problem = "writable by other users"
        elif st.st_size > _MAX_RECORD_BYTES:
            problem = f"{st.st_size} bytes, more than a record holds"
        else:
            problem, entries = _parse_record(f.read())
            if problem is None:
                return entries
    _warn(f"ignoring {path} ({problem}); the base's weight files are hashed in full")
    return {}


def _parse_record(raw: bytes) -> tuple[str | None, dict[str, dict]]:
    """(what is wrong with `raw` or None, its entries)."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        return f"not JSON: {e}", {}
    if not isinstance(data, dict) or data.get("version") != _RECORD_VERSION:
        return f"not a version {_RECORD_VERSION} record", {}
    entries = data.get("files")
    if not isinstance(entries, dict):
        return "no files", {}
    for key, entry in entries.items():
        well_formed = (
            os.path.isabs(key)
            and isinstance(entry, dict)
            and set(entry) == {*_INT_FIELDS, *_HEX_FIELDS}
            and all(type(entry[f]) is int and entry[f] >= 0 for f in _INT_FIELDS)
            and all(isinstance(entry[f], str) and _SHA256.fullmatch(entry[f]) for f in _HEX_FIELDS)
        )
        if not well_formed:
            return f"malformed entry for {key!r}", {}
    return None, entries


def _write_record(path: Path, entries: dict[str, dict]) -> None:
    """Replace the record atomically with `entries`, less those whose file is gone or changed
    (so it holds only files that exist); a record that cannot be written is warned about."""
    kept = {}
    for key, entry in entries.items():
        try:
            st = os.stat(key)
        except OSError:
            continue
        current = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if current == tuple(entry[f] for f in _INT_FIELDS):
            kept[key] = entry
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _RECORD_VERSION, "files": kept}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _warn(
            f"cannot write {path} ({e.strerror}): the base's weight files will be hashed in "
            "full again at the next start (set XDG_CACHE_HOME to a writable directory)"
        )


def record(hashes: dict[str, str], dest: Path) -> None:
    """Write `hashes` (of `weight_hashes`) as checkpoint directory `dest`'s record."""
    (dest / BASE_WEIGHTS).write_text(json.dumps({"files": hashes}, indent=1))


def check_base(checkpoint: Path, model_dir: Path) -> None:
    """CheckpointError naming the files in which `model_dir`'s weights differ from the base
    `checkpoint` was trained from; a warning when `checkpoint` records none (written before
    checkpoints did), after which model.path is checked for tensor shapes only."""
    saved_file = checkpoint / BASE_WEIGHTS
    if not saved_file.is_file():
        _warn(
            f"{checkpoint} has no {BASE_WEIGHTS} (written by an earlier version): "
            f"model.path={model_dir} is checked for tensor shapes only, and a changed "
            "weight value there would make the resumed run diverge unnoticed"
        )
        return
    try:
        saved = json.loads(saved_file.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{saved_file} is unreadable ({e!r}); the checkpoint is damaged"
        ) from e
    if not (isinstance(saved, dict) and all(isinstance(v, str) for v in saved.values())):
        raise CheckpointError(f"{saved_file} holds no file hashes; the checkpoint is damaged")
    now = weight_hashes(model_dir)
    differ = []
    for name in sorted(saved.keys() | now.keys()):
        if name not in now:
            differ.append(f"{name} is missing")
        elif name not in saved:
            differ.append(f"{name} is new")
        elif saved[name] != now[name]:
            differ.append(
                f"{name} has sha256 {now[name][:12]}…, the checkpoint's base {saved[name][:12]}…"
            )
    if differ:
        raise CheckpointError(
            f"model.path={model_dir} is not the base checkpoint {checkpoint} was trained from "
            f"({'; '.join(differ)}): the resumed run would reload its frozen reference and "
            "frozen parameters from it and diverge. Point model.path at the original base "
            "model, or start a fresh run on this one"
        )
