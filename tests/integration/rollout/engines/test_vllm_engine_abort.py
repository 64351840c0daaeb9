"""VLLMEngine's abort on a real vLLM engine in a Ray actor: requests ask vLLM for final outputs
only, so an abort must recover what vLLM holds back (tests/unit/rollout/engines/test_torch_engine.py
pins the same contract for the PyTorch engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from rl.config import RolloutConfig
from rl.types import Sample, SamplingParams, fresh_samples
from rollout.engines.vllm_engine import VLLMEngine

pytestmark = pytest.mark.integration

CFG = RolloutConfig(kv_cache_gb=0.0625, max_model_len=128)
PARAMS = SamplingParams(n=16, temperature=1.0, max_new_tokens=48, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        engine = ray.remote(num_cpus=1)(VLLMEngine).remote(str(tiny_model_dir), CFG, "float32", 0)
        yield engine
    finally:
        ray.shutdown()


def _group() -> list[Sample]:
    return fresh_samples([[5, 6, 7]], PARAMS.n, [0])


def test_abort_hands_back_held_tokens_and_the_finished_samples_of_a_running_group(
    engine,
) -> None:
    """A seeded group generated to the end, then again aborted after k steps: the samples that
    had stopped by then come back whole, the others with the first k tokens of the full run
    and their log-probs."""
    full = ray.get(engine.generate.remote(_group(), PARAMS))
    lengths = sorted(len(s.response_ids) for s in full)
    assert lengths[0] < PARAMS.max_new_tokens, "no sample of the group stops early"
    num_steps = lengths[0] + 2  # the first step prefills and samples the first token

    ray.get(engine.start.remote(_group(), PARAMS))
    for _ in range(num_steps):
        assert ray.get(engine.step.remote()) == []  # the group is not over
    stopped = sorted(ray.get(engine.abort.remote()), key=lambda s: s.index)

    assert [s.index for s in stopped] == list(range(PARAMS.n))
    num_finished = 0
    for sample, whole in zip(stopped, full, strict=True):
        if len(whole.response_ids) <= num_steps:
            num_finished += 1
            assert sample.finish_reason == "stop"
            assert sample.response_ids == whole.response_ids
        else:
            assert sample.finish_reason == "abort"
            assert sample.response_ids == whole.response_ids[:num_steps]
        assert sample.logprobs == pytest.approx(whole.logprobs[: len(sample.response_ids)])
        assert sample.token_versions == [0] * len(sample.response_ids)
    assert 0 < num_finished < PARAMS.n
    # Nothing of the aborted requests lingers in the engine.
    again = ray.get(engine.generate.remote(_group(), PARAMS))
    assert [s.response_ids for s in again] == [s.response_ids for s in full]
