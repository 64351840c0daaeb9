"""Checkpoint directories on disk: atomic writes, a manifest of checksums, and discovery.

A checkpoint is `run_dir/checkpoints/step_NNNNNN/`. Its files are written into a sibling
`.tmp-...` directory, fsynced, listed with their sizes and sha256 in `manifest.json` (written
last), and the directory is renamed into place, so a crash or a failed write at any moment
leaves the previous checkpoints exactly as they were. What goes inside (trainer shards,
driver state) is up to the caller; this module knows files only, so the CLI can check a
checkpoint before anything heavy starts.

Only `step_NNNNNN` directories are checkpoints to `newest_valid` and to keep_last's pruning.
A resume from a checkpoint that is not the newest moves the newer ones into
`abandoned-<time>/` (`set_aside`), so nothing the resumed run does later (a fault restart,
`--resume auto`, pruning) returns to the abandoned timeline or deletes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"
# A committed checkpoint moved aside while the same step is written again (a resumed run's
# final step): `.displaced-step_NNNNNN-<id>`, until its replacement is in place.
_DISPLACED_PREFIX = ".displaced-"
# Checkpoints of a timeline a resume left (`set_aside`): kept, out of every search.
ABANDONED_PREFIX = "abandoned-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The step of committed checkpoint directory `path` (step_NNNNNN), from its name."""
    assert path.name.startswith(_PREFIX) and path.name[len(_PREFIX) :].isdigit(), path
    return int(path.name[len(_PREFIX) :])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Files hashed at once: hashlib releases the GIL while it hashes a chunk and a read while it
# waits, so threads overlap reading and hashing across files, up to a core each (and at most
# 8 read streams, which fast storage needs and one disk still serves).
_HASH_THREADS = min(8, len(os.sched_getaffinity(0)))


def sha256_files(paths: list[Path]) -> list[str]:
    """The sha256 of each of `paths`, in order, several files at a time."""
    if len(paths) <= 1 or _HASH_THREADS == 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), _HASH_THREADS), thread_name_prefix="sha256") as pool:
        return list(pool.map(sha256_file, paths))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


class CheckpointWriter:
    """Writes checkpoints under `root`, keeping the newest `keep_last`."""

    def __init__(self, root: Path, keep_last: int) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last}: keep at least 1 checkpoint")
        self.root = root
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        """A fresh temporary directory to write step `step`'s files into."""
        self.root.mkdir(parents=True, exist_ok=True)
        restore_displaced(self.root)
        # Left by a writer that crashed: never a checkpoint, safe to delete.
        for stale in self.root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"{_TMP_PREFIX}{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Checksum, fsync and rename `tmp` into place as step `step`; prune old ones."""
        files = _files(tmp)
        for path in files:
            _fsync(path)
        entries = {
            str(path.relative_to(tmp)): {"bytes": path.stat().st_size, "sha256": digest}
            for path, digest in zip(files, sha256_files(files), strict=True)
        }
        manifest = {"step": step, "created": time.time(), "files": entries}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        for directory in {p.parent for p in files} | {tmp}:
            _fsync(directory)
        final = self.root / checkpoint_name(step)
        if final.exists():  # the same step written again (a resumed run's final step)
            # A directory cannot replace another in one rename: a crash between the two
            # leaves the old one displaced, and `restore_displaced` puts it back.
            old = self.root / f"{_DISPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync(self.root)
        self._prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old)


def restore_displaced(root: Path) -> None:
    """Finish what a writer that crashed while rewriting a step left: its old checkpoint,
    moved aside, goes back in place unless the new one made it there (then it is deleted)."""
    for displaced in root.glob(f"{_DISPLACED_PREFIX}*"):
        final = root / displaced.name[len(_DISPLACED_PREFIX) :].rsplit("-", 1)[0]
        if final.exists():
            shutil.rmtree(displaced)
        else:
            displaced.rename(final)


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest first (not verified)."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(found, key=checkpoint_step)


def verify(path: Path) -> dict:
    """The manifest of checkpoint `path` once every file in it checks out; CheckpointError
    naming the first file that is missing, truncated or altered."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (give a step_NNNNNN directory)")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {path} is not a complete checkpoint (a write "
            "that did not finish?); resume from an earlier one or with --resume auto"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{manifest_path} is unreadable ({e}); the checkpoint is damaged"
        ) from e
    root = path.resolve()
    files = []
    for name, entry in entries.items():
        file = path / name
        # The manifest is as untrusted as the rest of the directory: a name that leads out of
        # it (absolute, `..`, or through a symlink) would have this read any file it names.
        if not file.resolve().is_relative_to(root):
            raise CheckpointError(
                f"{manifest_path} names {name!r}, which is outside the checkpoint {path}"
            )
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {file} has {size} bytes, the manifest says {entry['bytes']} "
                "(truncated?)"
            )
        files.append(file)
    # Hashed once every file is known to be there, in full: the slow part, several at a time.
    for file, entry, digest in zip(files, entries.values(), sha256_files(files), strict=True):
        if digest != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {file} does not match its sha256 checksum")
    return manifest


def newest_valid(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `root` that verifies or None, why each newer one was
    skipped). A checkpoint a crashed rewrite left displaced is restored first."""
    restore_displaced(root)
    skipped = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return path, skipped
    return None, skipped


def set_aside(root: Path, checkpoints: list[Path]) -> Path:
    """Move `checkpoints` (directories in `root`) into a new `root/abandoned-<time>/`, which
    no search for a checkpoint and no pruning looks into; returns that directory."""
    assert checkpoints and all(p.parent == root for p in checkpoints), checkpoints
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, k = root / f"{ABANDONED_PREFIX}{stamp}", 2
    while aside.exists():
        aside, k = root / f"{ABANDONED_PREFIX}{stamp}-{k}", k + 1
    aside.mkdir()
    # A crash midway leaves some in view; the same resume, run again, moves the rest.
    for path in checkpoints:
        path.rename(aside / path.name)
    _fsync(aside)
    _fsync(root)
    return aside


def adopt(root: Path, path: Path, step: int) -> Path:
    """Bring checkpoint `path`, outside `root`, in as root's step `step`: its files are
    hard-linked (copied where `root` is on another filesystem) into a temporary directory,
    verified and renamed into place. Links are safe: no checkpoint file is written in place."""
    final = root / checkpoint_name(step)
    assert not final.exists(), final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        for directory, _, names in os.walk(path):  # symlinked directories are not entered
            source = Path(directory)
            dest = tmp / source.relative_to(path)
            dest.mkdir(parents=True, exist_ok=True)
            for name in names:
                # A symlink is not brought in: verify() then names the file the copy lacks.
                if (source / name).is_symlink():
                    continue
                try:
                    os.link(source / name, dest / name)
                except OSError:
                    shutil.copy2(source / name, dest / name)
                _fsync(dest / name)
            _fsync(dest)
        verify(tmp)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(root)
    return final
