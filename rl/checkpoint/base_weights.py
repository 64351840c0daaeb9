"""The base model's weights as a checkpoint records them, so a resume can tell a changed base.

A checkpoint's shards hold the trained policy (and critic), but a resumed run reloads the
frozen reference and the frozen parameters (`model.frozen`) from `model.path`. Every
checkpoint therefore records the sha256 of each of the base's weight files (`BASE_WEIGHTS`),
and a resume refuses a model.path whose weight files differ in any byte. Hashing reads every
weight file once, so one process hashes a directory once (the CLI's check, the driver's
record and its fault restarts share it) for as long as the files' inode, size and
modification and change times stay the same (and were not just modified).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rl.checkpoint.store import CheckpointError, sha256_file

BASE_WEIGHTS = "base_weights.json"
# Files of an HF model directory that hold its weights or say which file holds a tensor.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

# A file modified this close to its hashing could change again without its stat showing it
# (timestamps are coarse: git's "racily clean" entries); such hashes are not remembered.
_RACY_NS = 3_000_000_000
# model directory -> (its weight files' stat signature, their hashes)
_hashed: dict[Path, tuple[tuple, dict[str, str]]] = {}
# Checkpoints already warned about recording no hashes (the CLI and the driver both check).
_warned: set[Path] = set()


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


def weight_hashes(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} of the weight files at the top of HF model `model_dir` (where
    transformers loads them from)."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and is_weight_file(p.name))
    signature = tuple(
        (p.name, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
        for p, s in ((p, p.stat()) for p in files)
    )
    key = model_dir.resolve()
    if key in _hashed and _hashed[key][0] == signature:
        return dict(_hashed[key][1])
    started = time.time_ns()
    hashes = {p.name: sha256_file(p) for p in files}
    if all(max(mtime, ctime) < started - _RACY_NS for *_, mtime, ctime in signature):
        _hashed[key] = (signature, hashes)
    return hashes


def record(hashes: dict[str, str], dest: Path) -> None:
    """Write `hashes` (of `weight_hashes`) as checkpoint directory `dest`'s record."""
    (dest / BASE_WEIGHTS).write_text(json.dumps({"files": hashes}, indent=1))


def check_base(checkpoint: Path, model_dir: Path) -> None:
    """CheckpointError naming the files in which `model_dir`'s weights differ from the base
    `checkpoint` was trained from; a warning when `checkpoint` records none (written before
    checkpoints did), after which model.path is checked for tensor shapes only."""
    record_file = checkpoint / BASE_WEIGHTS
    if not record_file.is_file():
        if checkpoint.resolve() not in _warned:
            _warned.add(checkpoint.resolve())
            print(
                f"warning: {checkpoint} has no {BASE_WEIGHTS} (written by an earlier version): "
                f"model.path={model_dir} is checked for tensor shapes only, and a changed "
                "weight value there would make the resumed run diverge unnoticed",
                file=sys.stderr,
            )
        return
    try:
        saved = json.loads(record_file.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{record_file} is unreadable ({e!r}); the checkpoint is damaged"
        ) from e
    if not (isinstance(saved, dict) and all(isinstance(v, str) for v in saved.values())):
        raise CheckpointError(f"{record_file} holds no file hashes; the checkpoint is damaged")
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
