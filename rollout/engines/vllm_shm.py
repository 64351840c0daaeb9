"""vLLM's shared memory, removed after engines that died.

With tensor parallelism, vLLM's executor and its worker processes make POSIX shared memory
(message queues and a tensor arena, /dev/shm/psm_*, semaphores, /dev/shm/sem.mp-*, and on
CPU the TP group's all-reduce arena, /dev/shm/vllm_dist_*-cpushm_*) and
unlink it when they shut down or their objects are collected: never, when Ray kills the
engine's actor. So each engine records the segments its processes map, under its owner tag
(`rl.shm_owners.owner_tag`: host, pid and start time), and an engine starting on the
host removes the segments of every record whose owner has exited, then the record.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil

from rl.shm_owners import SHM_DIR, host_tag, owner_tag

# Message queues and tensor arenas, semaphores, and on CPU the TP group's all-reduce arena
# (vllm/distributed/device_communicators/cpu_communicator.py: IDENT-GROUP-[RANKS]-cpushm_N).
_SEGMENT = re.compile(
    r"psm_[0-9a-f]+|sem\.mp-[\w-]+|vllm_dist_[0-9a-f]+-[\w:]+-\[[0-9-]+\]-cpushm_[0-9]+"
)
_RECORD = re.compile(r"tandem-vllm-(?P<host>.+)-(?P<pid>\d+)-(?P<start>\d+)\.json")


def _record_path(owner: str, shm_dir: Path) -> Path:
    return shm_dir / f"tandem-vllm-{owner}.json"


def mapped_segments(pid: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """The names of vLLM's kind of shared memory that process `pid` and its descendants map."""
    names = set()
    processes = [psutil.Process(pid)]
    processes += processes[0].children(recursive=True)
    for process in processes:
        try:
            lines = Path(f"/proc/{process.pid}/maps").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile, or not ours to read
        for line in lines:  # address, perms, offset, device, inode, then the file mapped
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue  # anonymous memory
            path = Path(fields[5])
            if path.parent == shm_dir and _SEGMENT.fullmatch(path.name):
                names.add(path.name)
    return sorted(names)


def record_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Record the segments this engine's processes map (this process and its descendants);
    returns their names. An engine that maps none (no tensor parallelism) writes no record:
    one killed would leave just the record behind."""
    owner = owner_tag(os.getpid())
    assert owner is not None  # this process is running
    names = mapped_segments(os.getpid(), shm_dir)
    if not names:
        return names
    path = _record_path(owner, shm_dir)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(names))
    tmp.replace(path)
    return names


def forget_segments(shm_dir: Path = SHM_DIR) -> None:
    """Drop this engine's record once vLLM has shut down and unlinked its segments."""
    owner = owner_tag(os.getpid())
    assert owner is not None
    _record_path(owner, shm_dir).unlink(missing_ok=True)


def remove_dead_engines_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments recorded by engines of this host whose process has exited, and
    their records; returns the segments' names. Live engines' records and anything not named
    like vLLM's segments are kept."""
    host = host_tag()
    removed = []
    for record in shm_dir.glob("tandem-vllm-*.json"):
        match = _RECORD.fullmatch(record.name)
        if match is None:
            continue
        owner = f"{match['host']}-{match['pid']}-{match['start']}"
        if match["host"] != host or owner_tag(int(match["pid"])) == owner:
            continue  # another host's (in a shared /dev/shm), or alive
        try:
            names = json.loads(record.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue  # another engine is removing it
        for name in names:
            if isinstance(name, str) and _SEGMENT.fullmatch(name):
                try:
                    (shm_dir / name).unlink()
                except FileNotFoundError:
                    continue
                removed.append(name)
        record.unlink(missing_ok=True)
    return removed
