"""`rl eval MODEL --data FILE` and `rl generate MODEL PROMPT`: one model, one vLLM engine.

With `--environment NAME` (rl.agents.environment) every sample is a multi-turn episode run by
the rollout workers' loop (rollout.agent_loop), tools in a sandboxed pool; its answer (the
last assistant message) is what the task scores, and `rl generate` prints the transcript with
which tokens the model sampled and which the environment inserted.

MODEL is a Hugging Face model directory (a run's `hf/` export, a base) or a run checkpoint
(`runs/NAME/checkpoints/step_NNNNNN`), which is exported to a temporary directory first.
Prompts go through the model's chat template as in training (rl.data.prompts). `rl eval` scores
every row of FILE with the task's verifier: greedy accuracy, and with `--k K` K samples per
prompt at the given temperature, pass@K (a prompt counts when any of its K samples is right)
and pass@1 (the mean over samples). `rl generate` prints samples with each token's log-prob.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rl.checkpoint.store import MANIFEST, CheckpointError
from rl.config import AgentConfig, DataConfig, RolloutConfig
from rl.data.tasks import TASKS, get_task
from rl.types import Sample, SamplingParams, fresh_samples


@dataclass
class EvalResult:
    num_prompts: int
    accuracy: float  # greedy
    k: int
    pass_at_k: float | None  # None when k == 1
    pass_at_1: float | None

    def describe(self) -> str:
        line = f"greedy accuracy {self.accuracy:.1%} over {self.num_prompts} prompts"
        if self.pass_at_k is not None:
            line += f"; pass@{self.k} {self.pass_at_k:.1%}, pass@1 {self.pass_at_1:.1%}"
        return line


def check_model(model: Path) -> None:
    """CheckpointError unless `model` is an HF model directory or a run checkpoint."""
    if not (model / MANIFEST).is_file() and not (model / "config.json").is_file():
        raise CheckpointError(
            f"{model} is neither an HF model directory (no config.json) nor a run checkpoint "
            "(no manifest.json); give e.g. runs/NAME/hf or runs/NAME/checkpoints/step_000100"
        )


@contextmanager
def model_directory(model: Path) -> Iterator[Path]:
    """`model` as an HF directory: as is, or a run checkpoint exported for the duration."""
    check_model(model)
    if (model / MANIFEST).is_file():
        from rl.checkpoint.export import export_model

        with tempfile.TemporaryDirectory(prefix="rl-eval-") as tmp:
            yield export_model(model, Path(tmp) / "hf")
        return
    yield model


def task_of(model: Path, task: str | None) -> str:
    """The task to score with: `task`, else the one the model's base was built for
    (base_info.json) or its run was configured with (driver.json)."""
    if task is not None:
        return task
    recorded_in = (
        (model / "base_info.json", ("task",)),
        (model / "driver.json", ("config", "data", "task")),
    )
    for recorded, key in recorded_in:
        if recorded.is_file():
            value = json.loads(recorded.read_text())
            for part in key:
                value = value.get(part, {}) if isinstance(value, dict) else {}
            if isinstance(value, str):
                return value
    raise ValueError(
        f"{model} does not record its task: give --task (one of {', '.join(TASKS.names())})"
    )


def agent_of(model: Path, environment: str | None, max_turns: int | None) -> AgentConfig | None:
    """The agent set-up to evaluate with: `environment` if given, else the one the model
    records (an agent base's base_info.json, a run checkpoint's driver.json); None: none.
    `max_turns` overrides the recorded or default limit."""
    recorded: dict = {}
    source = "--environment"
    for path, key in (
        (model / "base_info.json", ("agent",)),
        (model / "driver.json", ("config", "agent")),
    ):
        if path.is_file():
            value = json.loads(path.read_text())
            for part in key:
                value = value.get(part, {}) if isinstance(value, dict) else {}
            if isinstance(value, dict) and value.get("environment"):
                recorded, source = value, str(path)
                break
    if environment is not None:
        recorded, source = {"environment": environment}, "--environment"
    if not recorded:
        return None
    try:
        agent = AgentConfig(**recorded)
        if max_turns is not None:
            agent.max_turns = max_turns
    except ValueError as exc:  # pydantic's errors name the key
        raise ValueError(f"agent set-up in {source}: {exc}") from None
    from rl.agents.environment import check_environment

    check_environment(agent.environment)
    if agent.max_turns < 1:
        raise ValueError(f"--max-turns must be >= 1, got {agent.max_turns}")
    return agent


class Evaluator:
    """One in-process rollout engine (`rollout.engines.registry`: vllm or torch) over an HF model
    directory, in fp32; with `agent` enabled, running episodes (`close()` stops the tools)."""

    def __init__(
        self,
        model_dir: Path,
        max_new_tokens: int,
        max_model_len: int,
        seed: int,
        engine: str,
        agent: AgentConfig | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from rollout.engines.registry import build_engine

        cfg = RolloutConfig(
            engine=engine, max_model_len=max_model_len, max_new_tokens=max_new_tokens
        )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        from rl.agents.agent_pool import agent_function

        self.agent = agent if agent is not None and agent.enabled else None
        self._tools = None
        self._function = self.agent is not None and agent_function(self.agent.environment)
        if (
            self.agent is not None and not self._function
        ):  # tools first: one that cannot load fails fast
            from rl.agents.resolve import get_environment
            from rl.agents.tool_pool import ToolPool

            self._env_class = get_environment(self.agent)
            self._tools = ToolPool.for_agent(self.agent)
        self.engine = build_engine(str(model_dir), cfg, "float32", seed)
        self.max_new_tokens, self.max_model_len, self.seed = max_new_tokens, max_model_len, seed

    def close(self) -> None:
        if self._tools is not None:
            from rl.agents.env_pool import close_env_pools

            self._tools.close()
            close_env_pools()

    def sample(self, examples: list[dict], n: int, temperature: float) -> list[list[Sample]]:
        """n samples per example (its "prompt", or for an agent the environment's reset), in
        example order."""
        params = SamplingParams(
            n=n, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=self.seed
        )
        if self.agent is None:
            from rl.data.prompts import encode_prompts

            ids = encode_prompts(self.tokenizer, [example["prompt"] for example in examples])
            samples = self.engine.generate(fresh_samples(ids, n, list(range(len(ids)))), params)
        else:
            samples = self._episodes(examples, n, params)
        return [samples[i * n : (i + 1) * n] for i in range(len(examples))]

    def _episodes(self, examples: list[dict], n: int, params: SamplingParams) -> list[Sample]:
        import asyncio

        if self._function:
            return asyncio.run(self._function_episodes(examples, n, params))

        from rl.agents.episode import start_group
        from rollout.agent_loop import AgentLoop
        from rollout.engine_loop import GenerationLoop

        schemas = self._tools.schemas or None
        samples = [
            sample
            for i, example in enumerate(examples)
            for sample in start_group(self._env_class, self.tokenizer, example, schemas, n, i)
        ]

        async def run() -> list[Sample]:
            loop = AgentLoop(GenerationLoop(self.engine), self.tokenizer, self.agent, self._tools)
            return await loop.generate(samples, params)

        return asyncio.run(run())

    async def _function_episodes(
        self, examples: list[dict], n: int, params: SamplingParams
    ) -> list[Sample]:
        """An agent function's episodes, through an endpoint in front of this engine."""
        from rl.agents.api_calls import start_episodes
        from rollout.api_agent_loop import ApiAgentLoop
        from rollout.engine_loop import GenerationLoop

        assert self.agent is not None
        samples = [s for i, example in enumerate(examples) for s in start_episodes(example, i, n)]
        loop = ApiAgentLoop(
            GenerationLoop(self.engine), self.tokenizer, self.agent, self.max_model_len
        )
        await loop.open()
        try:
            return await loop.generate(samples, params)
        finally:
            await loop.close()

    def evaluate(
        self, examples: list[dict], task_name: str, k: int, temperature: float
    ) -> EvalResult:
        task = get_task(task_name)

        def correct(groups: list[list]) -> list[list[float]]:
            return [
                [task.score(sample.response_text, example) for sample in group]
                for group, example in zip(groups, examples, strict=True)
            ]

        greedy = correct(self.sample(examples, 1, 0.0))
        accuracy = sum(scores[0] for scores in greedy) / len(examples)
        if k == 1:
            return EvalResult(len(examples), accuracy, 1, None, None)
        sampled = correct(self.sample(examples, k, temperature))
        pass_at_k = sum(max(scores) > 0 for scores in sampled) / len(examples)
        pass_at_1 = sum(sum(scores) / k for scores in sampled) / len(examples)
        return EvalResult(len(examples), accuracy, k, pass_at_k, pass_at_1)


def load_eval_rows(data_file: Path, task_name: str) -> list[dict]:
    """FILE's rows, checked as training data is (rl.data.loading: errors name the file and row)."""
    from rl.data.loading import load_examples

    cfg = DataConfig(task=task_name, train_files=[str(data_file)], test_files=[str(data_file)])
    return [dict(row) for row in load_examples(cfg, "test").dataset]


def format_samples(prompt: str, samples: list[Sample], tokenizer: object) -> str:
    """What `rl generate` prints: each sample's text (an episode's answer and its turns), then
    its tokens with their log-probs; tokens the environment inserted (tool results, template
    text) are shown as observations, without a log-prob."""
    lines = [f"prompt: {prompt!r}"]
    for sample in samples:
        sampled = sample.sampled_mask
        turns = f", {sample.episode.num_turns} turns" if sample.episode is not None else ""
        lines.append(
            f"sample {sample.index} ({sample.finish_reason}{turns}, log-prob "
            f"{sum(lp for lp, m in zip(sample.logprobs, sampled, strict=True) if m):.3f}): "
            f"{sample.response_text!r}"
        )
        if sample.episode is not None:
            for run_mask, run_ids in _runs(sample.response_ids, sampled):
                kind = "sampled    " if run_mask else "observation"
                lines.append(f"  {kind} {tokenizer.decode(run_ids)!r}")
        pairs = [
            f"{tokenizer.decode([token])!r} {logprob:.3f}"
            if m
            else f"{tokenizer.decode([token])!r} obs"
            for token, logprob, m in zip(sample.response_ids, sample.logprobs, sampled, strict=True)
        ]
        lines.append("  " + "  ".join(pairs))
    return "\n".join(lines)


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """`ids` cut where `mask` changes: (mask value, tokens) in order."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs
