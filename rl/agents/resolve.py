"""What an agent set-up (`agent.*`) runs: its environment class, a built-in one
(rl.agents.environment) or the stand-in for a user's (rl.agents.env_pool), and its tools. An
agent function (`openai:...`, rl.agents.agent_pool) has neither: it runs its own tools in its
sandbox and sends their schemas with its calls."""

from __future__ import annotations

from rl.agents.agent_pool import agent_function
from rl.agents.env_pool import sandboxed_environment
from rl.agents.environment import ENVIRONMENTS, Environment
from rl.config import AgentConfig
from rl.user_code import parse_file_ref


def get_environment(cfg: AgentConfig) -> type[Environment]:
    """The class of `cfg.environment`: a registered one (ValueError naming the valid ones), or
    the stand-in for a user's `path/to/file.py:ClassName`, whose code runs only in sandboxed
    workers (rl.agents.env_pool; this starts them)."""
    assert agent_function(cfg.environment) is None, "an agent function has no environment class"
    if parse_file_ref(cfg.environment, f"agent.environment {cfg.environment!r}") is not None:
        return sandboxed_environment(cfg)
    return ENVIRONMENTS.get(cfg.environment)


def agent_tools(cfg: AgentConfig) -> list[str]:
    """The tools an agent set-up's episodes may call: its environment's, then `agent.tools`
    (none run here for an agent function: its tools are its own)."""
    if agent_function(cfg.environment) is not None:
        return []
    return [*get_environment(cfg).tools, *cfg.tools]
