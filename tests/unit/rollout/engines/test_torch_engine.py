"""The PyTorch rollout engine in this process, against transformers: rows that finish at
different steps leave the KV cache without disturbing the others, top-p log-probs are the
nucleus's, aborts hand back partial samples (Ray and weight sync: tests/integration)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.config import RolloutConfig
from rl.types import Sample, SamplingParams, fresh_samples
from rollout.engines.torch_engine import TorchEngine, _top_p

CFG = RolloutConfig(engine="torch", max_model_len=64)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine(str(tiny_model_dir), CFG, "float32", seed=0)


def _expected(model_dir: Path, sample: Sample, temperature: float, top_p: float) -> torch.Tensor:
    """The response tokens' log-probs recomputed over the whole sequence: [len(response)]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seq = sample.prompt_ids + sample.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, len(sample.prompt_ids) - 1 : -1]
    logits = _top_p(logits / temperature, top_p) if top_p < 1 else logits / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(_top_p(logits, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_top_p(logits, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(_top_p(logits, 0.01)).tolist() == [[True, False, False, False]]


def test_rows_finishing_at_different_steps_leave_the_others_exact(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    """Resumed samples with prefixes of 0..5 tokens reach max_new_tokens one step apart, so
    the cache drops a row at every step; each remaining row's log-probs stay transformers'."""
    samples = fresh_samples([[5, 6, 7], [20, 21, 22, 23, 24, 25]] * 3, 1, list(range(6)))
    for length, sample in enumerate(samples):
        sample.response_ids = [30 + i for i in range(length)]
        sample.logprobs = [0.0] * length
        sample.token_versions = [0] * length
        sample.finish_reason = "abort"
    params = SamplingParams(temperature=0.7, max_new_tokens=8, seed=3)
    engine.generate(samples, params)
    for length, sample in enumerate(samples):
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "length":
            assert len(sample.response_ids) == 8
        expected = _expected(tiny_model_dir, sample, 0.7, 1.0)[length:]
        assert (torch.tensor(sample.logprobs[length:]) - expected).abs().max() < 1e-4


def test_top_p_logprobs_are_renormalised_over_the_nucleus(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    params = SamplingParams(n=4, temperature=1.0, top_p=0.5, max_new_tokens=6, seed=1)
    samples = engine.generate(fresh_samples([[5, 6, 7], [40, 41]], 4, [0, 1]), params)
    for sample in samples:
        expected = _expected(tiny_model_dir, sample, 1.0, 0.5)
        assert (torch.tensor(sample.logprobs) - expected).abs().max() < 1e-4
        # Renormalised over half the mass: each token is likelier than without the nucleus.
        untruncated = _expected(tiny_model_dir, sample, 1.0, 1.0)
        assert (torch.tensor(sample.logprobs) - untruncated).min() > math.log(1.5)


def test_abort_hands_back_partial_samples_that_resume(engine: TorchEngine) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=2)
    samples = fresh_samples([[5, 6, 7]], 2, [0])
    engine.start(samples, params)
    engine.step()
    engine.step()
    aborted = engine.abort()
    assert engine.num_running == 0
    assert {id(s) for s in aborted} <= {id(s) for s in samples}
    for sample in aborted:
        assert sample.is_partial and len(sample.response_ids) == 2
    prefixes = [list(s.response_ids) for s in aborted]
    engine.generate(aborted, params)
    for sample, prefix in zip(aborted, prefixes, strict=True):
        assert sample.finish_reason in ("stop", "length")
        assert sample.response_ids[:2] == prefix
    with pytest.raises(ValueError, match="already finished"):
        engine.start(aborted, params)


def test_tensor_parallelism_is_refused(tiny_model_dir: Path) -> None:
    cfg = CFG.model_copy(update={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=1"):
        TorchEngine(str(tiny_model_dir), cfg, "float32", seed=0)


def test_a_group_prefills_its_prompt_once_and_samples_it_as_if_alone(
    engine: TorchEngine, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts x 4 samples run a prefill of 2 rows; each sample's log-probs are still the
    ones of its own whole sequence."""
    prefill_rows = []
    logits = engine._logits

    def recording(ids, mask, positions, cache):
        if cache.get_seq_length() == 0:
            prefill_rows.append(ids.shape[0])
        return logits(ids, mask, positions, cache)

    monkeypatch.setattr(engine, "_logits", recording)
    samples = fresh_samples([[5, 6, 7], [20, 21, 22, 23]], 4, [0, 1])
    engine.generate(samples, SamplingParams(temperature=0.7, max_new_tokens=6, seed=1))
    assert prefill_rows == [2]
    assert len({tuple(s.response_ids) for s in samples}) > 2  # the samples did differ
    for sample in samples:
        expected = _expected(tiny_model_dir, sample, 0.7, 1.0)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
