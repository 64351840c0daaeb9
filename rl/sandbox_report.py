"""What `rl train` prints at start and `--dry-run` prints about the sandboxes of a run: the
isolation this machine gives them (probed, rl.sandbox) and each pool's limits."""

from __future__ import annotations

from rl.agents.agent_pool import agent_function
from rl.config import Config
from rl.sandbox import probe
from rl.user_code import parse_file_ref


def isolation_report(cfg: Config) -> str:
    """What `rl train` prints at start and `--dry-run` prints: the isolation of the sandboxes
    that run users' code (probed on this machine) and each pool's limits. Raises
    SandboxRefused as `probe` does."""
    pools = [f"reward functions ({cfg.reward.num_processes} workers, {cfg.reward.memory_mb} MiB)"]
    if cfg.agent.enabled:
        agent = cfg.agent
        function = agent_function(agent.environment) is not None
        if function:  # its tools run in its own sandbox
            pools.append(
                f"the agent function ({agent.env_workers} workers, {agent.env_memory_mb} MiB, "
                "reaching only its endpoint)"
            )
        else:
            pools.append(f"tool calls ({agent.tool_workers} workers, {agent.tool_memory_mb} MiB)")
        if not function and parse_file_ref(agent.environment, "agent.environment"):
            pools.append(
                f"the environment ({agent.env_workers} workers, {agent.env_memory_mb} MiB)"
            )
    return f"sandbox for {', '.join(pools)}: {probe().summary()}"
