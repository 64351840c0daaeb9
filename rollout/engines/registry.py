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

EngineFactory = Callable[[str, RolloutConfig, str, int, LoraConfig | None, bool], RolloutEngine]


@dataclass(frozen=True)
class EngineTraits:
    tensor_parallel: bool = False  # it shards a model over rollout.tensor_parallel_size ranks
    compiles: bool = False  # rollout.compile chooses how it runs its model
    # It can record the experts a mixture of experts routes to (model.routing_replay) on CPU;
    # vLLM can only where its Model Runner V2 runs (Triton: a GPU).
    records_routing_on_cpu: bool = False


ENGINES: Registry[EngineFactory, EngineTraits] = Registry("rollout engine", EngineTraits)


@ENGINES.register("vllm", tensor_parallel=True, compiles=True)
def _vllm(
    model_path: str,
    cfg: RolloutConfig,
    dtype: str,
    seed: int,
    lora: LoraConfig | None,
    record_routing: bool,
) -> RolloutEngine:
    from rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, cfg, dtype, seed, lora, record_routing)


@ENGINES.register("torch", records_routing_on_cpu=True)
def _torch(
    model_path: str,
    cfg: RolloutConfig,
    dtype: str,
    seed: int,
    lora: LoraConfig | None,
    record_routing: bool,
) -> RolloutEngine:
    from rollout.engines.torch_engine import TorchEngine

    return TorchEngine(model_path, cfg, dtype, seed, lora, record_routing)


def build_engine(
    model_path: str,
    cfg: RolloutConfig,
    dtype: str,
    seed: int,
    lora: LoraConfig | None = None,
    record_routing: bool = False,
) -> RolloutEngine:
    """The engine `cfg.engine` names, serving the checkpoint at `model_path` (version 0), with
    `lora`'s adapters on it when enabled (their B zero until a weight sync: the base); with
    `record_routing`, each sample carries the experts its positions were routed to
    (rl.types.Sample.routed_experts)."""
    return ENGINES.get(cfg.engine)(model_path, cfg, dtype, seed, lora, record_routing)
