"""A local judge: an HF causal-LM directory served by a rollout engine (`judge.engine`, from
rollout.engines.registry, as the rollout workers build theirs), writing verdicts.

Plain class, no Ray; `rl.rewards.judge_worker.JudgeWorker` serves it as an actor. Each input
is the judge's user turn in its chat template; a call's inputs are generated together, at
most `judge.max_concurrency` at a time. A sampled verdict (judge.temperature > 0) is seeded
by its input alone, not by its place in a batch.
"""

from __future__ import annotations

import zlib

from transformers import AutoTokenizer

from rl.config import RolloutConfig
from rl.config.tree import JudgeConfig
from rl.data.prompts import encode_prompts
from rl.types import Sample, SamplingParams

Reply = tuple[str | None, str]  # (the judge's text, or None and why it failed)


class LocalJudge:
    """The judge model at `path` in an engine of its own; `judge(texts)` -> one Reply each."""

    def __init__(self, path: str, judge: JudgeConfig, seed: int) -> None:
        from rollout.engines.registry import build_engine

        self.judge = judge
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        engine_cfg = RolloutConfig(
            engine=judge.engine,
            max_model_len=judge.max_model_len,
            max_new_tokens=judge.max_new_tokens,
            temperature=judge.temperature,
            kv_cache_gb=judge.kv_cache_gb,
            gpu_memory_utilization=judge.gpu_memory_utilization,
        )
        self.engine = build_engine(path, engine_cfg, judge.dtype, seed)
        self._params = SamplingParams(
            max_new_tokens=judge.max_new_tokens, temperature=judge.temperature, seed=seed
        )

    def judge_texts(self, texts: list[str]) -> list[Reply]:
        """The judge's verdict on each input; an input too long for the engine fails alone."""
        replies: list[Reply] = [(None, "")] * len(texts)
        limit = self.judge.max_model_len - self.judge.max_new_tokens
        samples = []
        for i, (text, ids) in enumerate(
            zip(texts, encode_prompts(self.tokenizer, texts), strict=True)
        ):
            if len(ids) > limit:
                replies[i] = (
                    None,
                    f"the judge's input is {len(ids)} tokens; judge.max_model_len="
                    f"{self.judge.max_model_len} leaves {limit} after max_new_tokens",
                )
                continue
            # The input's checksum seeds it (SamplingParams.seed_of adds group_id).
            samples.append((i, Sample(prompt_ids=ids, group_id=zlib.crc32(text.encode()))))
        step = self.judge.max_concurrency
        for start in range(0, len(samples), step):
            chunk = samples[start : start + step]
            done = self.engine.generate([sample for _, sample in chunk], self._params)
            for (i, _), sample in zip(chunk, done, strict=True):
                replies[i] = (sample.response_text, "")
        return replies

    def close(self) -> None:
        self.engine.close()
