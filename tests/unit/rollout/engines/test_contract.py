"""Every registered engine meets the RolloutEngine contract the worker and loop call."""

from __future__ import annotations

import inspect

import pytest

from rollout.engines.contract import RolloutEngine
from rollout.engines.registry import ENGINES
from rollout.engines.torch_engine import TorchEngine
from rollout.engines.vllm_engine import VLLMEngine

_CALLS = [
    name
    for name, member in vars(RolloutEngine).items()
    if not name.startswith("_") and (callable(member) or isinstance(member, property))
]


def test_the_contract_holds_every_call_the_worker_makes() -> None:
    # rollout/worker.py and rollout/engine_loop.py call these on their engine.
    assert set(_CALLS) >= {
        "num_running", "start", "step", "abort", "generate", "score", "open_weight_receiver",
        "apply_weight_bucket", "finish_weight_update", "release_memory", "reclaim_weights",
        "reclaim_memory", "take_peak_memory_bytes",
    }  # fmt: skip


@pytest.mark.parametrize("engine", [VLLMEngine, TorchEngine])
def test_each_engine_implements_every_call_with_the_contracts_parameters(engine: type) -> None:
    for name in _CALLS:
        ours, theirs = getattr(RolloutEngine, name), getattr(engine, name)
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
            continue
        # Private parameters are a framework's (Ray's tracing adds `_ray_trace_ctx`).
        public = [p for p in inspect.signature(theirs).parameters if not p.startswith("_")]
        assert public == list(inspect.signature(ours).parameters), name


def test_the_registry_lists_both_engines_and_only_vllm_shards_or_compiles() -> None:
    assert ENGINES.names() == ["torch", "vllm"]
    assert ENGINES.names(lambda t: t.tensor_parallel) == ["vllm"]
    assert ENGINES.names(lambda t: t.compiles) == ["vllm"]
