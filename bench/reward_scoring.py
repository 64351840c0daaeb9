"""Reward scoring speed: RewardScorer on a batch of 512 addition samples with three function
terms (the `task` verifier, the `arithmetic` verifier, a user's length function in a file).

    .venv/bin/python bench/reward_scoring.py [--samples 512] [--rounds 5] [--processes N]

One warm-up call, then --rounds timed `score` calls on the same batch; prints a markdown row
with the median and the slowest milliseconds per batch, against the target: well under a
second for 512 samples (the time a step spends scoring its batch, which the driver overlaps
with generation). This is where that number is measured: tests/unit/rl/rewards/test_scorer.py
checks the scores alone, since a wall-clock bound there fails whenever other work shares the
cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_MS = 1000.0

LENGTH_REWARD = "def length(response, example):\n    return len(response) / 10\n"


def measure(num_samples: int, rounds: int, processes: int | None) -> list[float]:
    """Milliseconds of each timed `score` call (after one warm-up call)."""
    sys.path.insert(0, str(REPO))
    from rl.config import RewardConfig, RewardTermConfig
    from rl.data.tasks import get_task
    from rl.rewards import RewardScorer

    with tempfile.TemporaryDirectory() as tmp:
        rewards_file = Path(tmp) / "user_rewards.py"
        rewards_file.write_text(LENGTH_REWARD)
        names = [("task", 1.0), ("arithmetic", 2.0), (f"{rewards_file}:length", 0.5)]
        terms = [RewardTermConfig(name=name, weight=weight) for name, weight in names]
        options = {} if processes is None else {"num_processes": processes}
        cfg = RewardConfig(terms=terms, **options)
        examples = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(num_samples)]
        responses = [e["answer"] if i % 3 else "wrong" for i, e in enumerate(examples)]
        prompts = [e["prompt"] for e in examples]
        times = []
        with RewardScorer(cfg, get_task("addition")) as scorer:
            scorer.score(prompts, responses, examples)  # warm: workers import the terms
            for _ in range(rounds):
                start = time.perf_counter()
                _, metrics = scorer.score(prompts, responses, examples)
                times.append((time.perf_counter() - start) * 1000)
                assert metrics["reward/errors"] == metrics["reward/timeouts"] == 0, metrics
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=None, help="reward.num_processes")
    args = parser.parse_args()
    times = measure(args.samples, args.rounds, args.processes)
    print("| samples | function terms | median ms | slowest ms | target ms |")
    print("|---|---|---|---|---|")
    print(
        f"| {args.samples} | 3 | {statistics.median(times):.1f} | {max(times):.1f} | "
        f"< {TARGET_MS:.0f} |"
    )


if __name__ == "__main__":
    main()
