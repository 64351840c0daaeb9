"""The rollout worker actor: a thin Ray shell around one in-process `VLLMEngine`.

Resources and placement come from the caller (`RolloutWorker.options(num_cpus=...,
scheduling_strategy=...)`); Ray sets OMP_NUM_THREADS from the CPUs granted, and the
engine sizes its thread pool from it.
"""

from __future__ import annotations

import ray

from rl.config import RolloutConfig
from rl.types import Sample, SamplingParams
from rollout.vllm_engine import VLLMEngine


@ray.remote
class RolloutWorker:
    """One vLLM engine serving one policy version at a time."""

    def __init__(self, model_path: str, cfg: RolloutConfig, dtype: str, seed: int) -> None:
        self._engine = VLLMEngine(model_path, cfg, dtype, seed)

    def ready(self) -> float:
        """Returns once the engine is up: the seconds its startup took."""
        return self._engine.startup_seconds

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        group_ids: list[int],
        policy_version: int,
    ) -> list[Sample]:
        """`params.n` samples per prompt, ordered prompt by prompt (see VLLMEngine.generate)."""
        return self._engine.generate(prompts, params, group_ids, policy_version)

    def score(self, sequences: list[list[int]], num_prompt_tokens: list[int]) -> list[list[float]]:
        """Temperature-1 log-probs of each sequence's tokens after its prompt."""
        return self._engine.score(sequences, num_prompt_tokens)

    def open_weight_sync(self, plan_json: str, channel_spec: dict, first_member: int) -> None:
        self._engine.open_weight_sync(plan_json, channel_spec, first_member)

    def apply_weight_bucket(self, bucket: int, version: int) -> int:
        return self._engine.apply_weight_bucket(bucket, version)

    def finish_weight_update(self, version: int) -> dict[str, float]:
        return self._engine.finish_weight_update(version)

    def version(self) -> int:
        """The policy version of the weights being served."""
        return self._engine.version
