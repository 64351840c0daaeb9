"""Start-up cost of the base's identity check: hashing model.path's weight files (issue 44).

    .venv/bin/python bench/base_hashing.py [--gb 8] [--shards 4] [--dir DIR]

Writes a synthetic base of `--gb` GB of random bytes (os.urandom, so nothing below can
compress or deduplicate it) in `--shards` safetensors files under a new directory in `--dir`
(the system's temporary directory unless given), after checking the filesystem has room
for it and 4 GB more. Each file is fsynced and dropped from the page cache
(posix_fadvise DONTNEED, checked with util-linux's fincore where present), and the
benchmark waits out the racy window, so that every variant below reads from the disk. Then,
each in a fresh process, from a cold page cache:

- `one_thread`: sha256 of every file one after another (`rl.checkpoint.store.sha256_file`),
  which every `rl train` did before the record;
- `first_start`: `rl.checkpoint.base_weights.weight_hashes` with no record: several files
  hashed at once, the record written;
- `second_start`: `weight_hashes` again, the record matching: each file's header read.

The record goes to a temporary XDG_CACHE_HOME. Both are deleted at the end, also on failure.
Prints one JSON line per variant: seconds in the call, bytes read (/proc/self/io rchar),
GB/s over the base's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl.checkpoint import base_weights

REPO = Path(__file__).resolve().parents[1]
GB = 10**9
CHUNK = 64 * 2**20

_VARIANT = """
import json, sys, time
from pathlib import Path
from rl.checkpoint.base_weights import weight_hashes
from rl.checkpoint.store import sha256_file

def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

model, variant = Path(sys.argv[1]), sys.argv[2]
files = sorted(model.glob("*.safetensors"))
before, started = rchar(), time.perf_counter()
if variant == "one_thread":
    hashes = {p.name: sha256_file(p) for p in files}
else:
    hashes = weight_hashes(model)
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "read": rchar() - before, "hashes": hashes}))
"""


def write_base(directory: Path, total: int, shards: int) -> list[Path]:
    """`shards` one-tensor safetensors files of random bytes, `total` data bytes in all,
    fsynced and out of the page cache."""
    files = []
    per_shard = total // shards
    for i in range(shards):
        path = directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header = json.dumps(
            {"w": {"dtype": "U8", "shape": [per_shard], "data_offsets": [0, per_shard]}}
        ).encode()
        header = header.ljust(-(-len(header) // 8) * 8)
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_shard
            while left:
                n = min(CHUNK, left)
                f.write(os.urandom(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        files.append(path)
    drop_cache(files)
    return files


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(files: list[Path]) -> int | None:
    """Bytes of `files` in the page cache (fincore), None without fincore."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(line) for line in out.split())


def run_variant(model: Path, variant: str, cache: Path, files: list[Path]) -> dict:
    drop_cache(files)
    cached = cached_bytes(files)
    done = subprocess.run(
        [sys.executable, "-c", _VARIANT, str(model), variant],
        cwd=REPO,
        env={**os.environ, "XDG_CACHE_HOME": str(cache)},
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout)
    result["cached_before"] = cached
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=8.0, help="weight bytes, in 10^9")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    total = int(args.gb * GB)
    free = shutil.disk_usage(args.dir).free
    if free < total + 4 * GB:
        sys.exit(f"{args.dir} has {free / GB:.1f} GB free; the base needs {args.gb} GB + 4 GB")
    root = Path(tempfile.mkdtemp(prefix="tandem-base-hashing-", dir=args.dir))
    try:
        model, cache = root / "model", root / "cache"
        model.mkdir()
        started = time.perf_counter()
        files = write_base(model, total, args.shards)
        print(f"wrote {args.gb} GB in {args.shards} files in {time.perf_counter() - started:.0f} s")
        # A file changed within the racy window of its hashing is not remembered.
        time.sleep(base_weights._RACY_NS / 1e9 + 1)
        hashes = None
        for variant in ("one_thread", "first_start", "second_start"):
            result = run_variant(model, variant, cache, files)
            assert hashes is None or result["hashes"] == hashes, variant
            hashes = result["hashes"]
            print(
                json.dumps(
                    {
                        "variant": variant,
                        "seconds": round(result["seconds"], 3),
                        "read_gb": round(result["read"] / GB, 4),
                        "gb_per_s": round(total / GB / result["seconds"], 2),
                        "cached_before_mb": None
                        if result["cached_before"] is None
                        else round(result["cached_before"] / 2**20, 1),
                    }
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
