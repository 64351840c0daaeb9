"""A tiny Qwen2 with Qwen2.5's chat template whose turns end by themselves, the engines built
in a test's process, and the log-prob parity of what they sampled with a plain HF forward:
shared by the agent loops' integration tests (tests/integration/rollout)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

from rl.config import BaseBuildConfig, RolloutConfig
from rl.types import Sample
from rollout.engines.contract import RolloutEngine
from rollout.engines.registry import build_engine
from tests.helpers.chat_templates import qwen_tokenizer
from trainer.hf_model import new_model, save_hf_atomic

PARITY_TOL = 1e-4  # fp32 engine log-probs against a plain HF forward
TEMPERATURE = 0.7
# Prompts (Qwen2.5's system prompt lists the tools) are ~590 tokens with python, ~820 with two.
# The tokenizer is small: ~1 token per character of text outside its corpus.
MAX_NEW_TOKENS = 256
# vLLM engines share this process: a small KV cache each (GPU: a small share of memory).
ROLLOUT = RolloutConfig(
    kv_cache_gb=0.0625, gpu_memory_utilization=0.1, max_model_len=1280, temperature=TEMPERATURE
)


def make_turns_short(model: torch.nn.Module, eos: int, boost: float = 0.4) -> None:
    """Make the end-of-turn token likely (~10% a token at temperature 0.7) whatever the
    context: one hidden dimension is the same large value in every token's embedding, so it
    dominates the final norm's output, and only EOS's output row gains from it. (Tied, every
    output row holds the constant, EOS's raised above it: the same gain.)"""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        head = model.lm_head.weight
        head[eos, 0] = head[:, 0].mean() + boost


def build_checkpoint(path: Path, tied: bool) -> Path:
    """A 2-layer Qwen2 (head_dim 32, for vLLM's CPU attention) with Qwen2.5's template."""
    tokenizer = qwen_tokenizer()
    cfg = BaseBuildConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        tie_word_embeddings=tied,
    )
    model = new_model(cfg, tokenizer, seed=0)
    make_turns_short(model, tokenizer.eos_token_id)
    return save_hf_atomic(model, tokenizer, path)


class Engines:
    """Engines built in this process: one shared per (engine, model) and fresh ones (another
    worker). vLLM in this process sets environment variables, torch's thread count and a
    torch.distributed group; `close` puts them back."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self.model_dirs = model_dirs
        self._shared: dict[tuple[str, str], RolloutEngine] = {}
        self._all: list[RolloutEngine] = []
        self._environ = dict(os.environ)
        self._threads = torch.get_num_threads()

    def shared(self, name: str, kind: str) -> RolloutEngine:
        if (name, kind) not in self._shared:
            self._shared[name, kind] = self.fresh(name, kind)
        return self._shared[name, kind]

    def fresh(self, name: str, kind: str) -> RolloutEngine:
        cfg = ROLLOUT.model_copy(update={"engine": name})
        engine = build_engine(str(self.model_dirs[kind]), cfg, "float32", 0)
        self._all.append(engine)
        return engine

    def close(self) -> None:
        self._shared.clear()
        self._all.clear()
        gc.collect()
        if "vllm" in sys.modules:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        os.environ.clear()
        os.environ.update(self._environ)
        torch.set_num_threads(self._threads)


def hf_logprobs(model, sample: Sample) -> torch.Tensor:
    """log softmax(logits / T) of each response token given everything before it."""
    seq = sample.prompt_ids + sample.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def parity_gap(model, sample: Sample) -> float:
    """Largest |engine - HF| log-prob over the sampled tokens."""
    sampled = torch.tensor(sample.loss_mask[: len(sample.response_ids)]) == 1
    gap = torch.tensor(sample.logprobs) - hf_logprobs(model, sample)
    return gap[sampled].abs().max().item()
