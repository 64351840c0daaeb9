"""Agent bases (`rl build-base` of a recipe with `agent.environment`): SFT rows from the
environment's demonstrations, and greedy episode accuracy for early stopping.

A demonstration becomes tokens exactly as a rollout would build it (rl.agents.trajectory):
assistant turns encoded with their end-of-turn token and trained on, observations rendered by
the template after the history and not trained on. The accuracy runs whole episodes, tools
in the sandboxed pool, with the in-memory model generating each turn greedily: the same loop
as the rollout workers (rollout.agent_loop) over another generator.
"""

from __future__ import annotations

import asyncio

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rl.agents.environment import Environment, Message
from rl.agents.episode import start_group
from rl.agents.tool_pool import ToolPool
from rl.agents.trajectory import add_observation, end_turn
from rl.config import AgentConfig
from rl.data.tasks import Task
from rl.types import Sample, SamplingParams
from rollout.agent_loop import AgentLoop

IGNORE = -100  # label value that cross-entropy skips


def demonstration(env_class: type[Environment], example: dict) -> list[Message]:
    """`example`'s demonstration; ValueError when the environment gives none."""
    messages = env_class().demonstration(example)
    if messages is None:
        raise ValueError(
            f"environment {env_class.__name__} has no demonstration(example) to build a base "
            "from: point model.path at a model that already calls tools"
        )
    return messages


def demonstration_row(
    env_class: type[Environment],
    tokenizer: PreTrainedTokenizerBase,
    example: dict,
    tools: list[dict] | None,
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of `example`'s demonstration: labels on the assistant turns only."""
    messages = demonstration(env_class, example)
    sample = start_group(env_class, tokenizer, example, tools, 1, 0)[0]
    start = len(sample.episode.messages)
    if messages[:start] != sample.episode.messages:
        raise ValueError(f"{env_class.__name__}.demonstration does not start with reset()")
    pending: list[dict] = []
    for message in messages[start:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            add_observation(tokenizer, sample, pending)
            pending = []
        ids = tokenizer.encode(message["content"], add_special_tokens=False)
        ids.append(tokenizer.eos_token_id)
        sample.response_ids += ids
        sample.logprobs += [0.0] * len(ids)
        sample.token_versions += [0] * len(ids)
        end_turn(tokenizer, sample)
    assert not pending, "a demonstration ends with the assistant's answer"
    labels = [IGNORE] * len(sample.prompt_ids) + [
        token if sampled else IGNORE
        for token, sampled in zip(sample.response_ids, sample.sampled_mask, strict=True)
    ]
    return sample.prompt_ids + sample.response_ids, labels


class _GreedyTurns:
    """`generate` as AgentLoop asks it of rollout.engine_loop.GenerationLoop, by an in-memory
    HF model, greedy: the turns asked for in one event-loop tick run as one batch."""

    engine = None

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._queue: list[tuple[Sample, asyncio.Future]] = []

    def interrupt(self) -> int:
        return 0

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        futures = []
        for sample in samples:
            futures.append(asyncio.get_running_loop().create_future())
            if not self._queue:
                asyncio.get_running_loop().call_soon(self._flush, params)
            self._queue.append((sample, futures[-1]))
        await asyncio.gather(*futures)
        return samples

    @torch.no_grad()
    def _flush(self, params: SamplingParams) -> None:
        batch, self._queue = self._queue, []
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = [s.prompt_ids + s.response_ids for s, _ in batch]
        width = max(map(len, rows))
        room = params.max_new_tokens - min(len(s.response_ids) for s, _ in batch)
        generated = self.model.generate(
            input_ids=torch.tensor([[pad] * (width - len(r)) + r for r in rows]),
            attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]),
            max_new_tokens=room,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )[:, width:].tolist()
        for (sample, future), new in zip(batch, generated, strict=True):
            new = new[: params.max_new_tokens - len(sample.response_ids)]
            if eos in new:
                new = new[: new.index(eos) + 1]
            sample.response_ids += new
            sample.logprobs += [0.0] * len(new)
            sample.token_versions += [0] * len(new)
            sample.finish_reason = "stop" if new and new[-1] == eos else "length"
            future.set_result(sample)


def greedy_episode_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[dict],
    env_class: type[Environment],
    tools: list[dict] | None,
    pool: ToolPool,
    cfg: AgentConfig,
    max_new_tokens: int,
) -> float:
    """Fraction of `examples` whose greedy episode's answer `task` scores correct."""
    was_training = model.training
    model.eval()
    samples = [
        s
        for i, example in enumerate(examples)
        for s in start_group(env_class, tokenizer, example, tools, 1, i)
    ]
    loop = AgentLoop(_GreedyTurns(model, tokenizer), tokenizer, cfg, pool)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    asyncio.run(loop.generate(samples, greedy))
    model.train(was_training)
    scores = [task.score(s.response_text, examples[s.group_id]) for s in samples]
    return sum(scores) / len(scores)
