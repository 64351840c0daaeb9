"""The vLLM engine's arguments chosen from the recipe."""

from __future__ import annotations

import pytest

from rl.config import RolloutConfig
from rollout.engines.vllm_engine import engine_args


@pytest.mark.parametrize(("compile", "eager"), [(None, True), (True, False), (False, True)])
def test_rollout_compile_sets_vllm_eager_mode_and_cpu_defaults_to_eager(
    compile: bool | None, eager: bool
) -> None:
    args = engine_args("/some/model", RolloutConfig(compile=compile), "float32", seed=0)
    assert args["enforce_eager"] is eager
