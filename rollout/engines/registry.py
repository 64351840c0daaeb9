"""The rollout engines a RolloutWorker can serve with (`rollout.engine`), with their traits.

Every engine meets `rollout.engines.contract.RolloutEngine` and gives the same samples: vLLM,
the default, and a plain PyTorch engine that serves tiny models on CPU with less fixed cost per
step (docs/benchmarks.md). A new engine is one file and one registration here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rl.config import LoraConfig, RolloutConfig
from rl.config.registry import Registry
from rollout.engines.contract import RolloutEngine

EngineFactory = Callable[[str, RolloutConfig, str, int, LoraConfig | None], RolloutEngine]


@dataclass(frozen=True)
class EngineTraits:
    tensor_parallel: bool = False  # it shards a model over rollout.tensor_parallel_size ranks
    compiles: bool = False  # rollout.compile chooses how it runs its model


ENGINES: Registry[EngineFactory, EngineTraits] = Registry("rollout engine", EngineTraits)


@ENGINES.register("vllm", tensor_parallel=True, compiles=True)
def _vllm(
    model_path: str, cfg: RolloutConfig, dtype: str, seed: int, lora: LoraConfig | None
) -> RolloutEngine:
    from rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, cfg, dtype, seed, lora)


@ENGINES.register("torch")
def _torch(
    model_path: str, cfg: RolloutConfig, dtype: str, seed: int, lora: LoraConfig | None
) -> RolloutEngine:
    from rollout.engines.torch_engine import TorchEngine

    return TorchEngine(model_path, cfg, dtype, seed, lora)


def build_engine(
    model_path: str, cfg: RolloutConfig, dtype: str, seed: int, lora: LoraConfig | None = None
) -> RolloutEngine:
    """The engine `cfg.engine` names, serving the checkpoint at `model_path` (version 0), with
    `lora`'s adapters on it when enabled (their B zero until a weight sync: the base)."""
    return ENGINES.get(cfg.engine)(model_path, cfg, dtype, seed, lora)
