"""Checkpoint directories: atomic commits, keep_last, and damage found and named."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from rl.checkpoint.store import (
    ABANDONED_PREFIX,
    MANIFEST,
    CheckpointError,
    CheckpointWriter,
    adopt,
    list_checkpoints,
    newest_valid,
    set_aside,
    verify,
)


def _write(writer: CheckpointWriter, step: int, payload: bytes = b"x" * 100) -> Path:
    tmp = writer.begin(step)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "shard0.distcp").write_bytes(payload)
    (tmp / "driver.json").write_text(json.dumps({"step": step}))
    return writer.commit(tmp, step)


def test_commits_are_whole_and_only_the_newest_keep_last_stay(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=2)
    paths = [_write(writer, step) for step in (1, 2, 3)]
    assert list_checkpoints(tmp_path) == paths[1:]
    manifest = verify(paths[2])
    assert manifest["step"] == 3
    assert set(manifest["files"]) == {"policy/shard0.distcp", "driver.json"}
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_write_failing_midway_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=1)
    good = _write(writer, 1)
    tmp = writer.begin(2)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "shard0.distcp").write_bytes(b"half")
    # The caller's writes raised (disk full, a rank died): it aborts the checkpoint.
    writer.abort(tmp)
    assert list_checkpoints(tmp_path) == [good]
    verify(good)
    # A writer killed before abort leaves only a .tmp- directory, which is never a checkpoint.
    crashed = writer.begin(3)
    (crashed / "driver.json").write_text("{")
    assert newest_valid(tmp_path) == (good, [])
    writer.begin(4)  # the next writer clears the leftovers
    assert len(list(tmp_path.glob(".tmp-*"))) == 1


def test_a_failed_manifest_write_keeps_the_checkpoint_out_of_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=2)
    good = _write(writer, 1)
    original = Path.write_text

    def full_disk(self: Path, text: str) -> int:
        if self.name == MANIFEST:
            raise OSError(28, "No space left on device")
        return original(self, text)

    monkeypatch.setattr(Path, "write_text", full_disk)
    tmp = writer.begin(2)
    (tmp / "driver.json").write_bytes(b"{}")
    with pytest.raises(OSError, match="No space"):
        writer.commit(tmp, 2)
    assert list_checkpoints(tmp_path) == [good]
    verify(good)


def test_rewriting_a_step_replaces_it_whole(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=2)
    _write(writer, 5, b"a" * 10)
    path = _write(writer, 5, b"b" * 20)
    assert (path / "policy" / "shard0.distcp").read_bytes() == b"b" * 20
    verify(path)


def test_a_crash_between_the_renames_of_a_rewrite_loses_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewriting step 5 moves the old one aside, then renames the new one in: killed in
    between, the old one is restored by the resume's search and by the next write."""
    writer = CheckpointWriter(tmp_path, keep_last=1)
    _write(writer, 5, b"a" * 10)
    original = Path.rename

    def killed_after_the_first(self: Path, target: Path) -> Path:
        moved = original(self, target)
        monkeypatch.setattr(Path, "rename", crashed)
        return moved

    def crashed(self: Path, target: Path) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "rename", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        _write(writer, 5, b"b" * 20)
    monkeypatch.setattr(Path, "rename", original)
    assert list_checkpoints(tmp_path) == []  # the gap: step 5 is only displaced

    restored, skipped = newest_valid(tmp_path)
    assert restored == tmp_path / "step_000005" and not skipped
    assert (restored / "policy" / "shard0.distcp").read_bytes() == b"a" * 10
    # The next write of step 5 replaces it whole and leaves nothing displaced behind.
    _write(writer, 5, b"c" * 30)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "policy" / "shard0.distcp").unlink(), "shard0.distcp is missing"),
        (
            lambda p: (p / "policy" / "shard0.distcp").write_bytes(b"x" * 50),
            "shard0.distcp has 50 bytes, the manifest says 100",
        ),
        (
            lambda p: (p / "policy" / "shard0.distcp").write_bytes(b"y" * 100),
            "shard0.distcp does not match its sha256",
        ),
        (lambda p: (p / MANIFEST).unlink(), "manifest.json is missing"),
        (lambda p: (p / MANIFEST).write_text("{"), "manifest.json is unreadable"),
    ],
)
def test_damage_is_named_and_auto_falls_back_to_the_newest_good(
    tmp_path: Path, damage, message: str
) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=3)
    good, bad = _write(writer, 1), _write(writer, 2)
    damage(bad)
    with pytest.raises(CheckpointError, match=message):
        verify(bad)
    path, skipped = newest_valid(tmp_path)
    assert path == good
    assert len(skipped) == 1 and str(bad) in skipped[0]


@pytest.mark.parametrize("escape", ["../outside.bin", "/etc/hostname", "link/outside.bin"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(
    tmp_path: Path, escape: str
) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoints", keep_last=3)
    checkpoint = _write(writer, 1)
    outside = tmp_path / "checkpoints" / "outside.bin"
    outside.write_bytes(b"secret")
    (checkpoint / "link").symlink_to(outside.parent, target_is_directory=True)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    # A correct size and checksum for what lies outside: only the path gives it away.
    manifest["files"][escape] = {"bytes": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        verify(checkpoint)


def test_keep_last_below_one_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint.keep_last=0"):
        CheckpointWriter(tmp_path, keep_last=0)


def test_set_aside_checkpoints_are_neither_found_nor_pruned(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=1)
    first = _write(writer, 1)
    aside = set_aside(tmp_path, [first])
    assert aside.name.startswith(ABANDONED_PREFIX)
    assert newest_valid(tmp_path) == (None, [])
    _write(writer, 2)
    _write(writer, 3)  # prunes step 2, not the step 1 set aside
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003"]
    verify(aside / "step_000001")


@pytest.mark.parametrize("cross_device", [False, True])
def test_adopt_brings_a_checkpoint_in_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cross_device: bool
) -> None:
    source = _write(CheckpointWriter(tmp_path / "elsewhere", keep_last=1), 4, b"z" * 64)
    if cross_device:

        def no_link(src: object, dst: object) -> None:
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", no_link)
    root = tmp_path / "run" / "checkpoints"
    adopted = adopt(root, source, 4)
    assert list_checkpoints(root) == [adopted] and verify(adopted)["step"] == 4
    assert (adopted / "policy" / "shard0.distcp").read_bytes() == b"z" * 64
    assert verify(source)["step"] == 4  # the source is left as it was
    assert not list(root.glob(".tmp-*"))
