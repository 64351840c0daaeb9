"""A prompt group's fresh samples: plain ones, or agent episodes (rl.agents.episode)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rl.agents.agent_pool import agent_function
from rl.agents.api_calls import start_episodes
from rl.agents.episode import start_group
from rl.agents.resolve import agent_tools, get_environment
from rl.agents.tool_pool import tool_schemas
from rl.config import Config
from rl.data.prompts import encode_prompt
from rl.types import Sample, fresh_samples


class GroupStarter:
    """`start(example, group_id, n)`: the n fresh samples answering `example`.

    Single-turn: the prompt as a user turn. Agent runs: each sample an episode of
    `agent.environment` (a user's runs in this process's sandboxed environment workers), whose
    prompt lists the tools' schemas (rl.agents.tool_pool.tool_schemas); the tools run only in
    the rollout workers' sandboxed pools. An agent function's episodes hold only their example:
    its first call makes the prompt (rollout.api_agent_loop).
    """

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.env_class = None
        self.tool_schemas: list[dict] | None = None
        self.agent_function = agent_function(cfg.agent.environment) is not None
        if cfg.agent.enabled and not self.agent_function:
            self.env_class = get_environment(cfg.agent)
            self.tool_schemas = tool_schemas(agent_tools(cfg.agent)) or None

    def start(self, example: dict, group_id: int, n: int) -> list[Sample]:
        if self.agent_function:
            return start_episodes(example, group_id, n)
        if self.env_class is None:
            return fresh_samples([encode_prompt(self.tokenizer, example["prompt"])], n, [group_id])
        return start_group(self.env_class, self.tokenizer, example, self.tool_schemas, n, group_id)
