"""`rl eval MODEL --data FILE` and `rl generate MODEL PROMPT`: one model, one vLLM engine.

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
from rl.config import DataConfig, RolloutConfig
from rl.data.tasks import TASKS, get_task
from rl.types import SamplingParams, fresh_samples


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
        from rl.checkpoint.export import export_checkpoint

        with tempfile.TemporaryDirectory(prefix="rl-eval-") as tmp:
            yield export_checkpoint(model, Path(tmp) / "hf")
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


class Evaluator:
    """One in-process rollout engine (`rollout.engines.registry`: vllm or torch) over an HF model
    directory, in fp32."""

    def __init__(
        self, model_dir: Path, max_new_tokens: int, max_model_len: int, seed: int, engine: str
    ) -> None:
        from transformers import AutoTokenizer

        from rollout.engines.registry import build_engine

        cfg = RolloutConfig(
            engine=engine, max_model_len=max_model_len, max_new_tokens=max_new_tokens
        )
        self.engine = build_engine(str(model_dir), cfg, "float32", seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_new_tokens, self.seed = max_new_tokens, seed

    def sample(self, prompts: list[str], n: int, temperature: float) -> list[list]:
        """n samples (rl.types.Sample) per prompt, in prompt order."""
        from rl.data.prompts import encode_prompts

        ids = encode_prompts(self.tokenizer, prompts)
        params = SamplingParams(
            n=n, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=self.seed
        )
        samples = self.engine.generate(fresh_samples(ids, n, list(range(len(ids)))), params)
        return [samples[i * n : (i + 1) * n] for i in range(len(ids))]

    def evaluate(
        self, examples: list[dict], task_name: str, k: int, temperature: float
    ) -> EvalResult:
        task = get_task(task_name)
        prompts = [example["prompt"] for example in examples]

        def correct(groups: list[list]) -> list[list[float]]:
            return [
                [task.score(sample.response_text, example) for sample in group]
                for group, example in zip(groups, examples, strict=True)
            ]

        greedy = correct(self.sample(prompts, 1, 0.0))
        accuracy = sum(scores[0] for scores in greedy) / len(examples)
        if k == 1:
            return EvalResult(len(examples), accuracy, 1, None, None)
        sampled = correct(self.sample(prompts, k, temperature))
        pass_at_k = sum(max(scores) > 0 for scores in sampled) / len(examples)
        pass_at_1 = sum(sum(scores) / k for scores in sampled) / len(examples)
        return EvalResult(len(examples), accuracy, k, pass_at_k, pass_at_1)


def load_eval_rows(data_file: Path, task_name: str) -> list[dict]:
    """FILE's rows, checked as training data is (rl.data.loading: errors name the file and row)."""
    from rl.data.loading import load_examples

    cfg = DataConfig(task=task_name, train_files=[str(data_file)], test_files=[str(data_file)])
    return [dict(row) for row in load_examples(cfg, "test").dataset]


def format_samples(prompt: str, samples: list, tokenizer: object) -> str:
    """What `rl generate` prints: each sample's text, then its tokens with their log-probs."""
    lines = [f"prompt: {prompt!r}"]
    for sample in samples:
        lines.append(
            f"sample {sample.index} ({sample.finish_reason}, log-prob "
            f"{sum(sample.logprobs):.3f}): {sample.response_text!r}"
        )
        tokens = [tokenizer.decode([token]) for token in sample.response_ids]
        pairs = zip(tokens, sample.logprobs, strict=True)
        lines.append("  " + "  ".join(f"{token!r} {logprob:.3f}" for token, logprob in pairs))
    return "\n".join(lines)
