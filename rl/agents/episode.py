"""One multi-turn episode: its state (`rl.types.Episode`, carried by its `rl.types.Sample`
wherever the sample goes, so an episode interrupted by a weight sync resumes on any rollout
worker), how a group of episodes starts, what happens between two turns, and the metrics of
a step's episodes.

Between turns (`observe`): the assistant's tool calls are parsed in the configured format
and checked against the tools' schemas; each valid one runs in the sandboxed tool pool; each
result, or the error the model must read (malformed call, unknown tool, bad arguments, a tool
that failed, hung or flooded), becomes one "tool" message, cut to `max_tool_output_tokens`
tokens and marked. The environment then decides the observation and whether the episode ends;
a user's environment that fails to (rl.agents.env_pool.EnvFailure) ends the episode there, as
does a chat template that cannot append the observation (rl.agents.trajectory's
TemplateMismatch, in rollout.agent_loop): counted, and the cause logged once per process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import PreTrainedTokenizerBase

from rl.agents.env_pool import EnvFailure
from rl.agents.environment import Environment, EnvStep
from rl.agents.tool_calls import ToolCall, error_observation, parse_tool_calls
from rl.agents.tool_pool import ToolResult
from rl.agents.trajectory import encode_messages, plain_ids
from rl.types import Episode, Sample

RunTool = Callable[[str, dict], Awaitable[ToolResult]]
logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # the causes `warn_once` has logged in this process


def start_group(
    env_class: type[Environment],
    tokenizer: PreTrainedTokenizerBase,
    example: dict,
    tools: list[dict] | None,
    n: int,
    group_id: int,
) -> list[Sample]:
    """The `n` fresh samples of one group: each its own environment, reset from `example`.
    The resets run at once, each in its own thread: a user's environment resets in its
    sandboxed workers (rl.agents.env_pool), up to `agent.env_workers` at a time, so a group
    starts in about one reset's time rather than `n`. The samples keep their order."""
    envs = [env_class() for _ in range(n)]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="env-reset") as threads:
        starts = list(threads.map(lambda env: env.reset(example), envs))
    if any(messages != starts[0] for messages in starts):
        raise ValueError(
            f"{env_class.__name__}.reset gave different messages for one example; the samples "
            "of a group must start from the same prompt"
        )
    prompt = encode_messages(tokenizer, starts[0], tools)
    return [
        Sample(
            prompt_ids=list(prompt),
            group_id=group_id,
            index=k,
            loss_mask=[],
            episode=Episode(env, list(messages), tools),
        )
        for k, (env, messages) in enumerate(zip(envs, starts, strict=True))
    ]


async def observe(
    episode: Episode,
    turn: str,
    tokenizer: PreTrainedTokenizerBase,
    run_tool: RunTool,
    call_format: str,
    max_tool_output_tokens: int,
) -> EnvStep:
    """What follows the assistant's `turn`: its tool calls run (concurrently, through
    `run_tool`), then the environment's step on their results."""
    calls = parse_tool_calls(turn, episode.tools or [], call_format)
    if calls:
        episode.turns_with_calls += 1
        episode.turns_well_formed += all(isinstance(c, ToolCall) for c in calls)
    submitted = time.time()
    results = [  # started together: a slow tool does not delay the others
        asyncio.ensure_future(run_tool(call.name, call.arguments))
        for call in calls
        if isinstance(call, ToolCall)
    ]
    messages = []
    for call in calls:
        episode.num_calls += 1
        if isinstance(call, ToolCall):
            result = await results.pop(0)
            episode.tool_spans.append((submitted, time.time()))
            episode.tool_seconds += result.seconds
            episode.num_runs += result.error not in ("bad_arguments", "unknown_tool")  # ran
            if result.error is not None:
                episode.errors[result.error] += 1
            # What the tool printed is cut; our own error texts are short and kept whole.
            name, content = call.name, _cut(tokenizer, result.output, max_tool_output_tokens)
        else:
            episode.errors[call.kind] += 1
            name, content = "error", error_observation(call, call_format)
        messages.append({"role": "tool", "name": name, "content": content})
    try:
        # In a thread: a user's environment steps in its sandbox (rl.agents.env_pool) while
        # this loop serves the other episodes.
        step = await asyncio.to_thread(episode.env.step, turn, messages)
    except EnvFailure as e:  # the episode ends here; the others go on
        warn_once(
            f"env {e.kind}",
            f"an episode ended because its environment failed ({e.kind}): {e}. Later failures "
            "of this kind end their episodes too, counted in agent/env_failures, not logged",
        )
        episode.env_failures += 1
        episode.env_timeouts += e.kind == "timeout"
        return EnvStep(done=True)
    episode.reward += step.reward
    return step


def warn_once(key: str, message: str) -> None:
    """Log `message` the first time a cause `key` comes up in this process: a cause that ends
    episode after episode is counted in the step's metrics, and said once."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(message)


def _cut(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens, the cut marked. Tokens as the observation
    encodes the text (rl.agents.trajectory): special tokens' text is plain text, kept in a
    cut output as in a whole one."""
    ids = plain_ids(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    kept = tokenizer.decode(
        ids[:max_tokens], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return f"{kept}\n[truncated: {len(ids) - max_tokens} more tokens]"


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """agent/* metrics of finished episodes (none for single-turn samples)."""
    episodes = [s.episode for s in samples if s.episode is not None]
    if not episodes:
        return {}
    num = len(episodes)
    sampled = sum(sum(s.sampled_mask) for s in samples if s.episode is not None)
    total = sum(len(s.response_ids) for s in samples if s.episode is not None)
    calls = sum(e.num_calls for e in episodes)
    with_calls = sum(e.turns_with_calls for e in episodes)
    metrics: dict[str, Any] = {
        "agent/turns_mean": sum(e.num_turns for e in episodes) / num,
        "agent/turns_max": float(max(e.num_turns for e in episodes)),
        "agent/tool_calls_mean": calls / num,
        "agent/tool_call_turn_frac": with_calls / max(sum(e.num_turns for e in episodes), 1),
        "agent/well_formed_call_frac": sum(e.turns_well_formed for e in episodes)
        / max(with_calls, 1),
        "agent/tool_latency_s": sum(e.tool_seconds for e in episodes)
        / max(sum(e.num_runs for e in episodes), 1),
        "agent/masked_token_frac": 1.0 - sampled / max(total, 1),
        "agent/max_turns_reached": sum(e.max_turns_reached for e in episodes) / num,
        "agent/env_reward_mean": sum(e.reward for e in episodes) / num,
        "agent/env_failures": float(sum(e.env_failures for e in episodes)),
        "agent/template_mismatches": float(sum(e.template_mismatches for e in episodes)),
        "agent/env_timeouts": float(sum(e.env_timeouts for e in episodes)),
    }
    functions = [e for e in episodes if e.env is None]
    if functions:  # an agent function's episodes (rl.agents.api_calls)
        metrics["agent/refused_calls"] = float(sum(e.refused_calls for e in functions))
        metrics["agent/prefix_breaks"] = float(sum(e.prefix_breaks for e in functions))
        metrics["agent/replay_mismatches"] = float(sum(e.replay_mismatches for e in functions))
        metrics["agent/segments_per_episode"] = sum(1 + len(e.segments) for e in functions) / len(
            functions
        )
    reporting = [s for s in samples if s.episode is not None and s.cached_prompt_tokens is not None]
    if reporting:  # vLLM: how much of each turn's history its prefix cache served
        metrics["agent/prefix_cache_hit_rate"] = sum(
            s.cached_prompt_tokens for s in reporting
        ) / max(sum(s.request_prompt_tokens for s in reporting), 1)
    errors: Counter = sum((e.errors for e in episodes), Counter())
    for kind, count in errors.items():
        metrics[f"agent/tool_errors_{kind}"] = float(count)
    return metrics
