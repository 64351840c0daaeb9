"""Recording the shared memory an engine's processes map, and removing what dead engines
left behind (and nothing else)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

from rl.shm_owners import SHM_DIR, host_tag, owner_tag
from rollout.engines import vllm_shm


def _dead_owner() -> str:
    """The owner tag a process of this host had: one that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "import os; print(open(f'/proc/{os.getpid()}/stat').read())"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    stat = child.communicate()[0]
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{host_tag()}-{child.pid}-{fields[19]}"


def test_segments_this_process_maps_are_recorded_and_forgotten_on_shutdown() -> None:
    segment = shared_memory.SharedMemory(create=True, size=4096)
    record = SHM_DIR / f"tandem-vllm-{owner_tag(os.getpid())}.json"
    try:
        names = vllm_shm.record_segments()
        assert segment.name in names
        assert json.loads(record.read_text()) == names
        vllm_shm.forget_segments()
        assert not record.exists()
    finally:
        record.unlink(missing_ok=True)
        segment.close()
        segment.unlink()


def test_an_engine_mapping_no_segments_writes_no_record(tmp_path: Path) -> None:
    assert vllm_shm.record_segments(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_dead_engines_segments_are_removed_and_nothing_else(tmp_path: Path) -> None:
    cpushm = "vllm_dist_3de09d55064841d38e3d7228531afbd4-tp:0-[0-1]-cpushm_0"  # a TP group's all-reduce arena on CPU
    for name in ("psm_0a1b2c3d", "sem.mp-x1y2z3", cpushm, "psm_live0001", "model.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    dead, live = _dead_owner(), owner_tag(os.getpid())
    other_host = "elsewhere-1-1"  # an engine of another host sharing the directory
    records = {
        dead: ["psm_0a1b2c3d", "sem.mp-x1y2z3", cpushm, "model.safetensors", "../escape"],
        live: ["psm_live0001"],
        other_host: ["psm_live0001"],
    }
    for owner, names in records.items():
        (tmp_path / f"tandem-vllm-{owner}.json").write_text(json.dumps(names))

    removed = vllm_shm.remove_dead_engines_segments(tmp_path)

    assert sorted(removed) == sorted(["psm_0a1b2c3d", "sem.mp-x1y2z3", cpushm])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model.safetensors", "psm_live0001", f"tandem-vllm-{live}.json"]
        + [f"tandem-vllm-{other_host}.json"]
    )
