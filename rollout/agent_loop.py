"""Multi-turn episodes on one engine: each sample a coroutine that generates a turn, runs its
tool calls in the sandboxed pool, appends the observation and generates the next turn.

The same interface as `rollout.engine_loop.GenerationLoop`, which it drives: a turn is one
generate call of one sample, resumed from everything the sample holds (its prompt and every
turn and observation so far), so the engine keeps stepping the other episodes while this one
waits for its tools, and vLLM's prefix cache serves the history instead of prefilling it
again (the torch engine prefills it again). Every token appended is the engine's own or an
observation's, never decoded and re-encoded (rl.agents.trajectory).

Episodes end at the environment's word (by default, the first turn without a tool call), at
`agent.max_turns`, or when the response would pass `rollout.max_new_tokens` (finish_reason
"length"). One that cannot go on ends there and the others go on: a user's environment that
failed (rl.agents.episode), or a chat template that cannot append the observation to what
the policy sampled (rl.agents.trajectory's TemplateMismatch: a turn ended on a special token
the template does not write there, or a template that re-renders earlier turns), counted in
agent/template_mismatches, the cause logged once per process.

With `stop_every` (deterministic abort points, rl.run.scheduler.loop) a turn stops partial
when the trajectory's length reaches a multiple of it; an interrupt (a weight sync under
partial_rollout "interrupt") aborts the turns being generated and stops the episodes waiting
for tools once their observation is in. Either way the episode comes back partial
and resumes from there under the next policy version, on any worker, since a sample carries
its episode.
"""

from __future__ import annotations

import asyncio
from functools import partial

from transformers import PreTrainedTokenizerBase

from rl.agents.episode import observe, warn_once
from rl.agents.tool_pool import ToolPool, ToolResult
from rl.agents.trajectory import TemplateMismatch, add_observation, end_turn
from rl.config import AgentConfig
from rl.types import Sample, SamplingParams
from rollout.engine_loop import FinishedBatches, GenerationLoop


class EpisodeLoop:
    """What the agent loops share (this module's AgentLoop and rollout.api_agent_loop's): the
    interface of `rollout.engine_loop.GenerationLoop`, over episodes that `_episodes` runs."""

    def __init__(self, generation: GenerationLoop) -> None:
        self.generation = generation
        self.engine = generation.engine
        self._interrupted = False
        self._batches = FinishedBatches()

    def start(self, batches: dict[int, list[Sample]], params: SamplingParams) -> None:
        """Start every batch's episodes; `poll` hands each batch back once all are done."""
        self._interrupted = False
        for key, samples in batches.items():
            task = asyncio.get_running_loop().create_task(self._episodes(samples, params))
            task.add_done_callback(partial(self._batches.settle, key))

    async def poll(self) -> dict[int, list[Sample]]:
        """{key: samples} of every batch finished (or aborted) since the last poll."""
        return await self._batches.poll()

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        self._interrupted = False
        return await self._episodes(samples, params)

    def interrupt(self) -> int:
        """Abort the turns being generated; episodes between turns stop before the next."""
        self._interrupted = True
        return self.generation.interrupt()

    async def _episodes(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        raise NotImplementedError


class AgentLoop(EpisodeLoop):
    def __init__(
        self,
        generation: GenerationLoop,
        tokenizer: PreTrainedTokenizerBase,
        cfg: AgentConfig,
        tools: ToolPool,
    ) -> None:
        super().__init__(generation)
        self.tokenizer, self.cfg, self.tools = tokenizer, cfg, tools

    async def _episodes(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        for sample in samples:
            if sample.episode is None:
                raise ValueError(
                    f"sample {sample.group_id}/{sample.index} has no episode: an agent run's "
                    "samples start with rl.agents.episode.start_group"
                )
        await asyncio.gather(*(self._episode(sample, params) for sample in samples))
        return samples

    async def _run_tool(self, name: str, arguments: dict) -> ToolResult:
        return await asyncio.wrap_future(self.tools.submit(name, arguments))

    async def _episode(self, sample: Sample, params: SamplingParams) -> None:
        episode = sample.episode
        assert episode is not None
        while True:
            if self._interrupted:
                sample.finish_reason = "abort"
                return
            await self.generation.generate([sample], params)
            if sample.is_partial:
                return  # stopped mid-turn (stop_every, or an interrupt): resumes from its tokens
            turn = end_turn(self.tokenizer, sample)
            if sample.finish_reason == "length":
                break
            step = await observe(
                episode,
                turn,
                self.tokenizer,
                self._run_tool,
                self.cfg.tool_call_format,
                self.cfg.max_tool_output_tokens,
            )
            if step.done or not step.messages:
                break
            if episode.num_turns >= self.cfg.max_turns:
                episode.max_turns_reached = True
                break
            try:
                added = add_observation(
                    self.tokenizer, sample, step.messages, params.max_new_tokens - 1
                )
            except TemplateMismatch as e:  # this episode cannot go on; the others do
                episode.template_mismatches += 1
                warn_once(
                    f"template {self.tokenizer.name_or_path}",
                    f"an episode ended: {e} Later mismatches end their episodes too, counted "
                    "in agent/template_mismatches, not logged",
                )
                break
            if added is None:
                sample.finish_reason = "length"  # no room left for the observation and a turn
                break
            sample.finish_reason = ""
        sample.response_text = episode.answer
