"""The rollout worker actor: a thin Ray shell around one in-process engine
(`rollout.engines.contract.RolloutEngine`: vLLM, or the PyTorch engine for tiny models on CPU).

An async actor: many `generate` calls are in flight at once and one `GenerationLoop` steps the
engine for all of them; every method runs on the actor's event-loop thread, between engine
steps. Resources and placement come from the caller (`RolloutWorker.options(num_cpus=...,
scheduling_strategy=...)`); Ray sets OMP_NUM_THREADS from the CPUs granted, and the engine
sizes its thread pool from it.
"""

from __future__ import annotations

import ray

from rl.config import AgentConfig, LoraConfig, RolloutConfig, SandboxConfig
from rl.observe.actor_logs import redirect_output
from rl.sandbox import configure as configure_sandbox
from rl.sync.transport import ChannelSpec
from rl.types import Sample, SamplingParams
from rollout.agent_loop import AgentLoop
from rollout.api_agent_loop import ApiAgentLoop
from rollout.engine_loop import GenerationLoop
from rollout.engines.contract import RolloutEngine
from rollout.engines.registry import build_engine


@ray.remote
class RolloutWorker:
    """One engine (`rollout.engine`) serving one policy version at a time; with `agent`
    enabled, every sample is a multi-turn episode (rollout.agent_loop) whose tools run in a
    sandboxed pool this worker starts."""

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        dtype: str,
        seed: int,
        agent: AgentConfig | None = None,
        log_file: str | None = None,
        lora: LoraConfig | None = None,
        sandbox: SandboxConfig | None = None,
        record_routing: bool = False,
    ) -> None:
        configure_sandbox(sandbox or SandboxConfig())  # for an agent's tools and environment
        self._args = (model_path, cfg, dtype, seed, lora, record_routing)
        self._agent = agent if agent is not None and agent.enabled else None
        self._log_file = log_file
        self._loop: GenerationLoop | AgentLoop | ApiAgentLoop | None = None

    async def log_to(self, log_file: str) -> None:
        """Send this process's output to `log_file` (rl.observe.actor_logs); call before `ready`."""
        redirect_output(log_file)

    async def ready(self) -> float:
        """Starts the engine (on the event-loop thread, where it will run: vLLM binds the
        starting thread's CPU threads) and returns the seconds its startup took."""
        if self._loop is None:
            generation = GenerationLoop(build_engine(*self._args))
            self._loop = generation if self._agent is None else await self._agent_loop(generation)
        return self._engine.startup_seconds

    async def _agent_loop(self, generation: GenerationLoop) -> AgentLoop | ApiAgentLoop:
        from transformers import AutoTokenizer

        from rl.agents.agent_pool import agent_function
        from rl.agents.tool_pool import ToolPool

        assert self._agent is not None
        tokenizer = AutoTokenizer.from_pretrained(self._args[0])
        if agent_function(self._agent.environment) is not None:
            loop = ApiAgentLoop(
                generation, tokenizer, self._agent, self._args[1].max_model_len, self._log_file
            )
            await loop.open()
            return loop
        tools = ToolPool.for_agent(self._agent, self._log_file)
        return AgentLoop(generation, tokenizer, self._agent, tools)

    @property
    def _engine(self) -> RolloutEngine:
        assert self._loop is not None, "call ready() first"
        return self._loop.engine

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate fresh or partial `samples` (see the engine's start); returns them once each
        has finished, or stopped at a `params.stop_every` point or by `interrupt` (then partial,
        to resume later)."""
        assert self._loop is not None, "call ready() first"
        return await self._loop.generate(samples, params)

    async def start(self, batches: dict[int, list[Sample]], params: SamplingParams) -> None:
        """Start batches of samples at once, each handed back under its key by `poll`."""
        assert self._loop is not None, "call ready() first"
        self._loop.start(batches, params)

    async def poll(self) -> dict[int, list[Sample]]:
        """{key: samples} of every batch finished or aborted since the last poll (waits for
        at least one)."""
        assert self._loop is not None, "call ready() first"
        return await self._loop.poll()

    async def interrupt(self) -> int:
        """Abort every sample being generated; returns how many were."""
        assert self._loop is not None, "call ready() first"
        return self._loop.interrupt()

    async def close(self) -> None:
        """Stop what this process started: the engine (vLLM's TP worker processes and their
        shared memory), an agent's tool pool (its worker processes and their directory) and a
        user's environment's workers. Ray kills an actor's children without running their
        cleanup, so the driver calls this before letting an actor go."""
        if self._loop is None:
            return
        if isinstance(self._loop, AgentLoop):
            from rl.agents.env_pool import close_env_pools

            self._loop.tools.close()
            close_env_pools()
        if isinstance(self._loop, ApiAgentLoop):
            await self._loop.close()
        self._engine.close()

    async def release_memory(self) -> bool:
        """Free the engine's device memory while a colocated trainer runs (GPU only)."""
        return self._engine.release_memory()

    async def reclaim_weights(self) -> None:
        self._engine.reclaim_weights()

    async def reclaim_memory(self) -> None:
        self._engine.reclaim_memory()

    async def peak_memory_mb(self) -> float:
        """The engine's peak memory since the previous call, MiB (the engine's
        take_peak_memory_bytes)."""
        return self._engine.take_peak_memory_bytes() / (1 << 20)

    async def score(
        self, sequences: list[list[int]], num_prompt_tokens: list[int]
    ) -> list[list[float]]:
        """Temperature-1 log-probs of each sequence's tokens after its prompt."""
        return self._engine.score(sequences, num_prompt_tokens)

    async def open_weight_receiver(
        self, plan_json: str, channel_spec: ChannelSpec, first_member: int
    ) -> None:
        self._engine.open_weight_receiver(plan_json, channel_spec, first_member)

    async def apply_weight_bucket(
        self, bucket: int, version: int, last: bool
    ) -> tuple[int, dict[str, float] | None]:
        """Load bucket `bucket` of `version` (the engine's apply_weight_bucket); returns the
        bytes its busiest TP rank read and, for the `last` bucket, the stats of closing the
        update (finish_weight_update) in the same call: one round trip fewer per sync."""
        num_bytes = self._engine.apply_weight_bucket(bucket, version)
        return num_bytes, self._engine.finish_weight_update(version) if last else None

    async def version(self) -> int:
        """The policy version of the weights being served."""
        return self._engine.version
