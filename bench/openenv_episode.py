"""What an OpenEnv episode's own server costs (rl.agents.openenv_agent): per episode, the fork
of a uvicorn server of the environment's app, the `/schema` read, OpenEnv's WebSocket session
(connect, reset, two steps, close), without the policy's calls.

    .venv/bin/python bench/openenv_episode.py [--episodes 30]

The environment is the integration tests' tandem_spell (two steps, then done). Runs in this
process, outside a sandbox (the agent worker's fork and its sandbox cost the same for every
agent function: bench/sandbox_start.py). Prints the median and p90 of each phase, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ENV_DIR = Path(__file__).resolve().parents[1] / "tests/integration/rollout/openenv_envs"


async def episode() -> dict[str, float]:
    from openenv.core import GenericEnvClient

    from rl.agents import openenv_agent

    times: dict[str, float] = {}
    start = time.perf_counter()
    url = openenv_agent.serve_episode_env()
    times["fork"] = time.perf_counter() - start
    async with httpx.AsyncClient() as http:
        (await http.get(f"{url}/schema")).raise_for_status()
    times["schema"] = time.perf_counter() - start - times["fork"]
    mark = time.perf_counter()
    async with GenericEnvClient(base_url=url) as env:
        await env.reset(seed=1)
        for message in ("apple", "apple"):
            await env.step({"message": message})
    times["session"] = time.perf_counter() - mark
    times["total"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=30)
    args = parser.parse_args()
    sys.path.insert(0, str(ENV_DIR))
    os.setpgrp()  # the servers are this group's: one signal ends them with the bench
    start = time.perf_counter()
    from rl.agents import openenv_agent  # OpenEnv's client and server, gradio, fastmcp

    openenv_agent.prepare("openenv:tandem_spell")
    took = time.perf_counter() - start
    print(f"an agent worker's start: import OpenEnv and the environment's app: {took:.1f} s")
    runs = [asyncio.run(episode()) for _ in range(args.episodes)]
    print("| phase | median ms | p90 ms |\n|---|---|---|")
    for phase in ("fork", "schema", "session", "total"):
        values = sorted(1e3 * run[phase] for run in runs)
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"| {phase} | {statistics.median(values):.1f} | {p90:.1f} |")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)


if __name__ == "__main__":
    main()
