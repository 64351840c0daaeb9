"""The shared-memory transport: FSDP2 shards written in place, whole tensors read back; slot
files private, and those of exited drivers deleted by the next run, a live one's kept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl.sync.pieces import bucket_tensors
from rl.sync.plan import owned_rows, plan_weight_sync
from rl.sync.shared_memory import (
    NUM_SLOTS,
    SHM_DIR,
    SharedMemorySpec,
    channel_prefix,
    create_slots,
    open_slots,
    owner_tag,
    remove_slots,
    remove_stale_slots,
    slot_paths,
    slots_bytes_needed,
    write_rows,
)
from rl.sync.transport import open_channel
from tests.helpers.repo import REPO
from tests.helpers.sync_specs import SYNC_SHAPE, SYNC_SPECS


@pytest.fixture
def prefix() -> Iterator[str]:
    """A channel this test process owns: deleted after the test, or by the first run after
    this process, should it be killed first."""
    name = channel_prefix()
    yield name
    remove_slots(name)


@pytest.mark.parametrize(
    ("world_size", "wire"), [(1, "float32"), (2, "float32"), (3, "float32"), (2, "bfloat16")]
)
def test_ranks_writing_their_rows_leave_whole_tensors_in_the_slot_in_the_wire_dtype(
    prefix: str, world_size: int, wire: str
) -> None:
    plan = plan_weight_sync(
        SYNC_SPECS, SYNC_SHAPE, world_size, 2, bucket_bytes=50_000, wire_dtype=wire
    )
    assert len(plan.buckets) > NUM_SLOTS  # slots are reused
    full = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(SYNC_SPECS)
    }
    writers = [create_slots(prefix, plan.slot_numel, wire)]
    writers += [open_slots(slot_paths(prefix), plan.slot_numel, wire) for _ in range(1, world_size)]
    reader = open_slots(slot_paths(prefix), plan.slot_numel, wire)  # another process's mapping
    # The files hold the wire dtype: bf16 moves half the bytes of fp32.
    element = {"float32": 4, "bfloat16": 2}[wire]
    assert os.path.getsize(slot_paths(prefix)[0]) == plan.slot_numel * element
    for bucket in range(len(plan.buckets)):
        for rank in range(world_size):
            shards = {  # the trainer's fp32 rows
                s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, world_size))]
                for s in plan.buckets[bucket]
            }
            write_rows(writers[rank][bucket % NUM_SLOTS], plan, bucket, rank, shards)
        got = bucket_tensors(reader[bucket % NUM_SLOTS], plan, bucket)
        assert [name for name, _ in got] == [s.name for s in plan.buckets[bucket]]
        for name, tensor in got:
            # Rounded as an engine of that dtype rounds fp32 weights when it loads them.
            assert torch.equal(tensor, full[name].to(getattr(torch, wire))), name


def test_missing_slot_files_name_the_host_requirement(prefix: str) -> None:
    with pytest.raises(FileNotFoundError, match="share one host"):
        open_slots(slot_paths(prefix), 16, "float32")


def test_remove_slots_deletes_the_channel_files(prefix: str) -> None:
    create_slots(prefix, 16, "float32")
    assert len(list(SHM_DIR.glob(f"{prefix}-*"))) == NUM_SLOTS
    remove_slots(prefix)
    assert not any(Path(p).exists() for p in slot_paths(prefix))


def test_channels_hand_readers_the_tensors_writers_wrote(prefix: str) -> None:
    plan = plan_weight_sync(
        SYNC_SPECS, SYNC_SHAPE, 2, 1, bucket_bytes=100_000, wire_dtype="float32"
    )
    spec = SharedMemorySpec(prefix)
    writers = [open_channel(plan, spec, member=rank) for rank in range(2)]  # rank 0 creates
    reader = open_channel(plan, spec, member=2)
    full = {s.name: torch.full(s.shape, float(i)) for i, s in enumerate(SYNC_SPECS)}
    for bucket in range(len(plan.buckets)):
        for rank, writer in enumerate(writers):
            rows = {
                s.name: full[s.name][slice(*owned_rows(s.num_rows, rank, 2))] for s in SYNC_SPECS
            }
            writer.write(bucket, rows, None)
        for name, tensor in reader.read(bucket):
            assert torch.equal(tensor, full[name])


def test_slot_files_are_private_whatever_the_umask(prefix: str) -> None:
    old_umask = os.umask(0)
    try:
        create_slots(prefix, 16, "float32")
    finally:
        os.umask(old_umask)
    for path in slot_paths(prefix):
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, path
        assert info.st_uid == os.geteuid()


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_an_existing_file_or_symlink_at_a_slot_path_is_never_written(
    prefix: str, planted: str, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not weights")
    path = Path(slot_paths(prefix)[1])
    if planted == "file":
        path.write_bytes(b"not weights")
    else:
        path.symlink_to(victim)
    with pytest.raises(FileExistsError, match=f"{path} already exists.*refusing"):
        create_slots(prefix, 16, "float32")
    assert victim.read_bytes() == b"not weights"
    assert path.is_symlink() == (planted == "symlink")
    if planted == "file":
        assert path.read_bytes() == b"not weights"


def test_readers_refuse_a_symlink_at_a_slot_path(prefix: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(64))
    paths = slot_paths(prefix)
    Path(paths[0]).symlink_to(victim)
    Path(paths[1]).write_bytes(bytes(64))
    with pytest.raises(PermissionError, match=f"{paths[0]} is a symlink"):
        open_slots(paths, 16, "float32")


def test_the_space_a_channel_needs_covers_both_slots_in_fp32() -> None:
    assert slots_bytes_needed(1 << 20, "float32") > NUM_SLOTS * 4 * (1 << 20)


def _exited_process(reap: bool) -> tuple[str, subprocess.Popen]:
    """A real process's owner tag, taken while it ran, and the process, which has exited on
    return; unless `reap`, it is a zombie (this process, its parent, has not waited for it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    tag = owner_tag(child.pid)
    assert tag is not None and f"-{child.pid}-" in tag
    child.stdin.close()
    if reap:
        child.wait()
    else:
        stat_file = Path(f"/proc/{child.pid}/stat")
        while stat_file.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
    return tag, child


def _channel_of_a_killed_driver() -> str:
    """The prefix of a channel a driver process created before it was SIGKILLed (so that no
    finalizer of its own ran)."""
    code = (
        "import sys\n"
        "from rl.sync.shared_memory import channel_prefix, create_slots\n"
        "prefix = channel_prefix()\n"
        "create_slots(prefix, 16, 'float32')\n"
        "print(prefix, flush=True)\n"
        "sys.stdin.read()\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,  # where `rl` imports from
    )
    prefix = driver.stdout.readline().strip()
    assert all(Path(path).is_file() for path in slot_paths(prefix)), prefix
    driver.kill()
    driver.wait()
    driver.stdin.close()
    driver.stdout.close()
    return prefix


def _segment(owner: str) -> str:
    """A channel's slot files, named as owned by `owner`."""
    prefix = f"tandem-{owner}-{uuid.uuid4().hex[:12]}"
    create_slots(prefix, 16, "float32")
    return prefix


def test_a_new_run_deletes_the_slots_of_exited_drivers_and_keeps_live_ones(
    tmp_path: Path,
) -> None:
    me = owner_tag(os.getpid())
    assert me is not None
    host, pid, start = me.split("-")
    other_host = "0" * 12 if host != "0" * 12 else "1" * 12
    children: list[subprocess.Popen] = []
    prefixes: dict[str, str] = {}
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    link = SHM_DIR / f"tandem-{host}-{pid}-{int(start) + 1}-{uuid.uuid4().hex[:12]}-slot0"
    try:
        prefixes["live"] = _segment(me)  # this process: a live driver
        prefixes["killed"] = _channel_of_a_killed_driver()
        exited, child = _exited_process(reap=True)
        prefixes["exited"] = _segment(exited)
        # A killed driver its parent has not waited for yet never runs again either.
        zombie, child = _exited_process(reap=False)
        children.append(child)
        prefixes["zombie"] = _segment(zombie)
        # This process's PID with another start time: an exited driver whose PID was reused.
        prefixes["reused_pid"] = _segment(f"{host}-{pid}-{int(start) + 1}")
        # Another host's (or PID namespace's) PIDs mean nothing here.
        prefixes["other_host"] = _segment(f"{other_host}-{pid}-{int(start) + 1}")
        # A symlink named like an exited driver's slot is neither followed nor removed.
        link.symlink_to(victim)

        removed = set(remove_stale_slots())  # others' too, of runs that exited meanwhile

        for name in ("killed", "exited", "zombie", "reused_pid"):
            for path in slot_paths(prefixes[name]):
                assert path in removed and not os.path.lexists(path), name
        for name in ("live", "other_host"):
            for path in slot_paths(prefixes[name]):
                assert path not in removed and Path(path).is_file(), name
        assert str(link) not in removed
        assert link.is_symlink() and victim.read_bytes() == b"kept"
    finally:
        for child in children:
            child.wait()
        for prefix in prefixes.values():
            remove_slots(prefix)
        link.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_slots_are_kept() -> None:
    exited, _ = _exited_process(reap=True)
    prefix = _segment(exited)
    try:
        for path in slot_paths(prefix):
            os.chown(path, 65534, -1)  # nobody's
        remove_stale_slots()
        assert all(Path(path).is_file() for path in slot_paths(prefix))
    finally:
        remove_slots(prefix)
