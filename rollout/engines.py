"""The rollout engines a RolloutWorker can serve with (`rollout.engine`), and the request
checks they share.

Both engines take the same calls (`rollout.engine_loop.SteppedEngine` plus scoring and weight
sync) and give the same samples: vLLM, the default, and a plain PyTorch engine that serves
tiny models on CPU with less fixed cost per step (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rl.config import RolloutConfig
from rl.registry import Registry
from rl.types import Sample, SamplingParams

if TYPE_CHECKING:
    from rollout.torch_engine import TorchEngine
    from rollout.vllm_engine import VLLMEngine

    RolloutEngine = VLLMEngine | TorchEngine

# A resumed sample draws fresh random numbers: its seed moves on by this per token it has.
RESUME_SEED_STRIDE = 1_000_003

ENGINES: Registry[Callable] = Registry("rollout engine")


@ENGINES.register("vllm")
def _vllm(model_path: str, cfg: RolloutConfig, dtype: str, seed: int) -> VLLMEngine:
    from rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, cfg, dtype, seed)


@ENGINES.register("torch")
def _torch(model_path: str, cfg: RolloutConfig, dtype: str, seed: int) -> TorchEngine:
    from rollout.torch_engine import TorchEngine

    return TorchEngine(model_path, cfg, dtype, seed)


def build_engine(model_path: str, cfg: RolloutConfig, dtype: str, seed: int) -> RolloutEngine:
    """The engine `cfg.engine` names, serving the checkpoint at `model_path` (version 0)."""
    return ENGINES.get(cfg.engine)(model_path, cfg, dtype, seed)


def sample_seed(params: SamplingParams, sample: Sample) -> int | None:
    """Sample k of group g draws with seed params.seed + g * n + k (moved on by the length of
    a resumed prefix), so a seeded batch reproduces however prompts are spread over workers."""
    if params.seed is None:
        return None
    seed = params.seed + sample.group_id * params.n + sample.index
    return seed + RESUME_SEED_STRIDE * len(sample.response_ids)


def check_startable(samples: list[Sample], params: SamplingParams, max_model_len: int) -> None:
    """Raise ValueError unless every sample is fresh or aborted and has room to generate."""
    for sample in samples:
        if sample.finish_reason not in ("", "abort"):
            raise ValueError(
                f"sample {sample.group_id}/{sample.index} already finished "
                f"({sample.finish_reason}); only fresh or aborted samples are generated"
            )
        if params.max_new_tokens - len(sample.response_ids) < 1:
            raise ValueError(
                f"sample {sample.group_id}/{sample.index} already has "
                f"{len(sample.response_ids)} tokens of max_new_tokens={params.max_new_tokens}"
            )
        if len(sample.prompt_ids) + params.max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt of {len(sample.prompt_ids)} tokens + rollout.max_new_tokens="
                f"{params.max_new_tokens} exceeds rollout.max_model_len={max_model_len}"
            )


def check_scorable(
    sequences: list[list[int]], num_prompt_tokens: list[int], max_model_len: int
) -> None:
    """Raise ValueError unless each sequence has a prompt length inside it and fits the engine."""
    if len(num_prompt_tokens) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(num_prompt_tokens)} prompt lengths")
    for seq, start in zip(sequences, num_prompt_tokens, strict=True):
        if not 1 <= start <= len(seq):
            raise ValueError(f"num_prompt_tokens={start} outside [1, {len(seq)}]")
        if len(seq) >= max_model_len:
            raise ValueError(
                f"sequence of {len(seq)} tokens needs rollout.max_model_len > {len(seq)}"
            )


def decode_responses(tokenizer: object, samples: list[Sample]) -> None:
    """Set each sample's response_text from its tokens, special tokens skipped (one batched
    decode is much cheaper than vLLM's per-token incremental detokenizer)."""
    if samples:
        texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        for sample, text in zip(samples, texts, strict=True):
            sample.response_text = text
