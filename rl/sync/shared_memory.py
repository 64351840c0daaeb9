"""The shared-memory transport (one host): two buffers ("slots"), files under /dev/shm that
every member maps. Bucket i goes to slot i % 2, so the trainer fills bucket i + 1 while the
rollout ranks still read bucket i (pipelined). Each tensor lies whole in a slot: rank w's rows
land at their place, so readers see full tensors without any gather or copy.

The slots hold the policy's weights, so they are private: created new (O_EXCL, never through a
symlink) with mode 0600, and opened without following symlinks. A channel's files are named
after the driver that owns them, `tandem-HOST-PID-START-RANDOM-slotK` (HOST: this machine's
boot and PID namespace; START: the driver's start time, which tells a reused PID apart), so
that a new run can delete the files of runs whose driver was killed before it could
(`remove_stale_slots`) without touching a live run's.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from rl.shm_owners import SHM_DIR, host_tag, owner_tag
from rl.sync.pieces import bucket_tensors
from rl.sync.plan import WIRE_BYTES, WeightSyncPlan, owned_rows
from rl.sync.transport import TRANSPORTS, SyncSite

NUM_SLOTS = 2
# Others share /dev/shm (vLLM's TP message queues, Ray, other runs) and may grow after the
# free-space check: the slots need this share of their size, and this many bytes, beyond it.
SHM_MARGIN = 1 / 8
SHM_RESERVE_BYTES = 16 << 20
_SLOT_FILE = re.compile(
    r"tandem-(?P<host>[0-9a-f]{12})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-[0-9a-f]{12}-slot[0-9]+"
)


def channel_prefix() -> str:
    """A new channel's prefix, owned by this process (the driver, which deletes the files)."""
    owner = owner_tag(os.getpid())
    assert owner is not None  # this process is running
    return f"tandem-{owner}-{uuid.uuid4().hex[:12]}"


def slot_paths(prefix: str) -> list[str]:
    """The files of the sync channel `prefix`."""
    return [str(SHM_DIR / f"{prefix}-slot{slot}") for slot in range(NUM_SLOTS)]


def slots_bytes_needed(numel: int, dtype: str) -> int:
    """Free /dev/shm a channel of slots of `numel` elements of `dtype` needs, with a margin."""
    size = NUM_SLOTS * numel * WIRE_BYTES[dtype]
    return size + int(size * SHM_MARGIN) + SHM_RESERVE_BYTES


def free_bytes() -> int:
    """Bytes free in /dev/shm (0 where there is none)."""
    try:
        fs = os.statvfs(SHM_DIR)
    except FileNotFoundError:
        return 0
    return fs.f_bavail * fs.f_frsize


def _map(fd: int, numel: int, dtype: str) -> torch.Tensor:
    """Map `numel` elements of `dtype` of the open file `fd` shared: a write by one process is
    seen by all. The mapping keeps its own reference to the file."""
    buffer = mmap.mmap(fd, numel * WIRE_BYTES[dtype])
    return torch.frombuffer(buffer, dtype=getattr(torch, dtype))


def create_slots(prefix: str, numel: int, dtype: str) -> list[torch.Tensor]:
    """Create the channel's files, private to this user, of `numel` elements of `dtype` and
    map them. A file or symlink already at a slot's path is refused, never written through."""
    slots = []
    for path in slot_paths(prefix):
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"weight-sync slot {path} already exists (a file or symlink this channel did "
                "not create): refusing to write the weights through it"
            ) from None
        try:
            os.ftruncate(fd, numel * WIRE_BYTES[dtype])
            slots.append(_map(fd, numel, dtype))
        finally:
            os.close(fd)
    return slots


def open_slots(paths: list[str], numel: int, dtype: str) -> list[torch.Tensor]:
    """Map existing slot files of `numel` elements of `dtype` shared (never through a
    symlink)."""
    slots = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"weight-sync slot {path} is missing: the trainer and this rollout worker must "
                "share one host (and its /dev/shm) for the shared-memory transport"
            ) from None
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise PermissionError(
                f"weight-sync slot {path} is a symlink: refusing to map the weights through it"
            ) from None
        try:
            slots.append(_map(fd, numel, dtype))
        finally:
            os.close(fd)
    return slots


def remove_slots(prefix: str) -> None:
    """Delete the channel's files (idempotent; also after a crash)."""
    for path in slot_paths(prefix):
        Path(path).unlink(missing_ok=True)


def remove_stale_slots() -> list[str]:
    """Delete the slot files of this user's runs on this host whose driver has exited (a
    driver killed outright never deletes its own); returns their paths. A live driver's files,
    other users', other hosts' or containers', symlinks and names not of this form are kept."""
    try:
        entries = list(os.scandir(SHM_DIR))
    except FileNotFoundError:
        return []
    host, user, removed = host_tag(), os.geteuid(), []
    for entry in entries:
        match = _SLOT_FILE.fullmatch(entry.name)
        if match is None or match["host"] != host:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # another run removed it meanwhile
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != user:
            continue
        try:
            alive = owner_tag(int(match["pid"])) == f"{host}-{match['pid']}-{match['start']}"
        except OSError:  # the owner cannot be looked at: it may live
            continue
        if alive:
            continue
        try:
            os.unlink(entry.path)  # a name: unlink never follows a symlink
        except FileNotFoundError:
            continue
        removed.append(entry.path)
    return removed


def write_rows(
    slot: torch.Tensor,
    plan: WeightSyncPlan,
    bucket: int,
    rank: int,
    local_rows: dict[str, torch.Tensor],
) -> None:
    """Copy trainer `rank`'s rows of every tensor of `bucket` (`local_rows[name]`: its FSDP2
    shard, any dtype and device) to their place in `slot`, cast to the slot's dtype."""
    for spec, offset in zip(plan.buckets[bucket], plan.offsets(bucket), strict=True):
        start, stop = owned_rows(spec.num_rows, rank, plan.world_size)
        local = local_rows[spec.name]
        assert local.numel() == (stop - start) * spec.num_cols, (spec, tuple(local.shape))
        first = offset + start * spec.num_cols
        slot[first : first + local.numel()].copy_(local.reshape(-1))


class SharedMemoryChannel:
    def __init__(self, plan: WeightSyncPlan, prefix: str, member: int) -> None:
        self._plan = plan
        # Member 0 (trainer rank 0) creates the files; it is opened before everyone else.
        if member == 0:
            self._slots = create_slots(prefix, plan.slot_numel, plan.wire_dtype)
        else:
            self._slots = open_slots(slot_paths(prefix), plan.slot_numel, plan.wire_dtype)
        self._member = member

    def write(
        self, bucket: int, local_rows: dict[str, torch.Tensor], replicas: list[int] | None
    ) -> None:
        slot = self._slots[bucket % NUM_SLOTS]  # every replica reads the same slot
        write_rows(slot, self._plan, bucket, self._member, local_rows)

    def read(self, bucket: int) -> list[tuple[str, torch.Tensor]]:
        return bucket_tensors(self._slots[bucket % NUM_SLOTS], self._plan, bucket)


@dataclass(frozen=True)
class SharedMemorySpec:
    prefix: str  # the slot files are /dev/shm/PREFIX-slot0 and -slot1

    def open(self, plan: WeightSyncPlan, member: int) -> SharedMemoryChannel:
        return SharedMemoryChannel(plan, self.prefix, member)

    def remove(self) -> None:
        remove_slots(self.prefix)


@TRANSPORTS.register("shared_memory", single_host=True, pipelined=True, creator_first=True)
def shared_memory_spec(site: SyncSite) -> SharedMemorySpec:
    return SharedMemorySpec(site.prefix)
