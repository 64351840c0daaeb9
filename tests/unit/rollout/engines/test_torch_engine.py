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
from rl.expert_routing import ExpertRouting, moe_routers
from rl.types import Sample, SamplingParams, fresh_samples
from rollout.engines.torch_engine import TorchEngine, _top_p
from tests.helpers.models import build_moe_checkpoint

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


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def _natural_routing(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """The experts transformers' own forward over `sequence` (all but its last token) routes
    each position to: [positions, layers, k], each row's ids sorted."""
    routing = ExpertRouting(model)
    with torch.no_grad():
        model(torch.tensor([sequence[:-1]]))
    routing.remove()
    return routing.recorded().sort(dim=-1).values


def test_recorded_routing_has_a_row_per_position_run_as_a_whole_forward_routes_it(
    moe_dir: Path,
) -> None:
    engine = TorchEngine(str(moe_dir), CFG, "float32", seed=0, record_routing=True)
    samples = fresh_samples([[5, 6, 7], [20, 21, 22, 23]], 2, [0, 1])
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=6, seed=7))
    for sample in samples:
        sequence = sample.prompt_ids + sample.response_ids
        record = sample.routed_experts
        assert record.dtype == torch.uint8 and record.shape == (len(sequence) - 1, 2, 2)
        expected = _natural_routing(AutoModelForCausalLM.from_pretrained(moe_dir), sequence)
        assert torch.equal(record.long().sort(dim=-1).values, expected)


def test_a_resumed_sample_keeps_the_rows_recorded_before_its_abort(moe_dir: Path) -> None:
    engine = TorchEngine(str(moe_dir), CFG, "float32", seed=0, record_routing=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7, stop_every=3)
    samples = fresh_samples([[5, 6, 7, 8]], 1, [0])
    engine.generate(samples, params)
    (sample,) = samples
    assert sample.finish_reason == "abort" and len(sample.response_ids) == 3
    first = sample.routed_experts
    assert len(first) == 4 + 3 - 1
    # The weights change before it resumes: its earlier rows stay as first recorded.
    with torch.no_grad():
        for router in moe_routers(engine._model):
            router.weight.neg_()
    while sample.finish_reason == "abort":
        engine.generate([sample], params)
    record = sample.routed_experts.long().sort(dim=-1).values
    sequence = sample.prompt_ids + sample.response_ids
    assert len(record) == len(sequence) - 1
    assert torch.equal(sample.routed_experts[: len(first)], first)
    now = _natural_routing(engine._model, sequence)
    assert torch.equal(record[len(first) :], now[len(first) :])
    assert not torch.equal(record[: len(first)], now[: len(first)])


def test_recording_routing_of_a_dense_model_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        TorchEngine(str(tiny_model_dir), CFG, "float32", seed=0, record_routing=True)
