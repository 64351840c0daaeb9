"""What the sandbox costs a worker's start (issue 44).

    .venv/bin/python bench/sandbox_start.py [--rounds 15]

Side by side, alternating, each round:

- `sandboxed`: a one-worker `rl.rewards.pool.FunctionPool` for the `arithmetic` verifier,
  from the call to its worker's "ready": the launcher (rl.isolation: namespaces, the private
  filesystem, the uid change), the worker's imports and its terms;
- `bare`: a fresh interpreter that does the same imports and loads the same term, until it
  says so: what a worker's start costs without a sandbox.

Prints one JSON line per variant: median, min and max seconds, and the isolation the
sandboxed workers got.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from rl.config import RewardConfig
from rl.data.tasks import get_task
from rl.rewards.pool import FunctionPool
from rl.rewards.terms import FunctionTerm
from rl.sandbox import clean_env

_BARE = (
    "import rl.rewards.pool_worker\n"
    "from rl.rewards.terms import FunctionTerm\n"
    "FunctionTerm.from_json({'name': 'arithmetic', 'kind': 'verifier', 'task': None, "
    "'path': '', 'function': ''}).load()\n"
    "print('ready', flush=True)\n"
    "import sys; sys.stdin.read()\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    terms = [FunctionTerm.from_name("arithmetic", get_task("addition"))]
    seconds: dict[str, list[float]] = {"sandboxed": [], "bare": []}
    isolation = ""
    for _ in range(args.rounds):
        start = time.perf_counter()
        pool = FunctionPool(terms, RewardConfig(num_processes=1))
        seconds["sandboxed"].append(time.perf_counter() - start)
        isolation = pool.isolation.summary()
        pool.close()
        start = time.perf_counter()
        bare = subprocess.Popen(
            [sys.executable, "-c", _BARE],
            env=clean_env(()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert bare.stdout.readline() == "ready\n"
        seconds["bare"].append(time.perf_counter() - start)
        bare.communicate("")
    for variant, values in seconds.items():
        record = {
            "variant": variant,
            "median_s": round(statistics.median(values), 4),
            "min_s": round(min(values), 4),
            "max_s": round(max(values), 4),
        }
        if variant == "sandboxed":
            record["isolation"] = isolation
        print(json.dumps(record))


if __name__ == "__main__":
    main()
