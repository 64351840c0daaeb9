"""Who owns a file in /dev/shm, for the files a process leaves there when it is killed: each
is named after its owner, `HOST-PID-START` (HOST: this machine's boot and PID namespace;
START: the process's start time, which tells a reused PID apart), so that a later process can
delete the files of owners that have exited without touching a live one's. The weight-sync
slots (rl.sync.shared_memory) and vLLM's segments (rollout.engines.vllm_shm) are named so.
"""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")


@functools.cache
def host_tag() -> str:
    """This boot of this machine and this PID namespace: a PID means one process only within
    both (hosts share nothing in /dev/shm, but containers may, each with its own PIDs)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:
        # Unknown: a tag of this process alone, so that no other run judges its owners here.
        return uuid.uuid4().hex[:12]
    key = f"{boot_id}:{namespace.st_dev}:{namespace.st_ino}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def owner_tag(pid: int) -> str | None:
    """`HOST-PID-START` naming process `pid` of this host while it lives; None once it has
    exited (a zombie included: it never runs again)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command name, which is in parentheses and may hold spaces: the state
    # (field 3) first, the start time in clock ticks since boot (field 22) 19 later.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return f"{host_tag()}-{pid}-{fields[19]}"
