"""A prompt group's fresh samples: plain ones, or agent episodes (rl.agents.episode)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

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
    the rollout workers' sandboxed pools.
    """

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.env_class = None
        self.tool_schemas: list[dict] | None = None
        if cfg.agent.enabled:
            self.env_class = get_environment(cfg.agent)
            self.tool_schemas = tool_schemas(agent_tools(cfg.agent)) or None

    def start(self, example: dict, group_id: int, n: int) -> list[Sample]:
        if self.env_class is None:
            return fresh_samples([encode_prompt(self.tokenizer, example["prompt"])], n, [group_id])
        return start_group(self.env_class, self.tokenizer, example, self.tool_schemas, n, group_id)
