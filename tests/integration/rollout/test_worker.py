"""RolloutWorker on real Ray, with each engine (vLLM and the PyTorch one): samples and behaviour
log-probs against transformers, and seeding, for untied and tied embeddings (weight sync:
tests/integration/rl/sync/test_weight_sync.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import ray
import torch
from ray.actor import ActorHandle
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rl.config import RolloutConfig
from rl.types import SamplingParams, fresh_samples
from rollout.worker import RolloutWorker

pytestmark = pytest.mark.integration

TEMPERATURE = 0.7
CFG = RolloutConfig(kv_cache_gb=0.0625, max_model_len=128, temperature=TEMPERATURE)
PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24, 25], [40, 41]]


@dataclass
class Rollout:
    """A worker and an HF model holding the same weights (tests that change one sync both)."""

    worker: ActorHandle
    hf: PreTrainedModel
    model_dir: Path


@pytest.fixture(scope="module", params=["vllm", "torch"])
def rollouts(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_tied_model_dir: Path
) -> dict[str, Rollout]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    dirs = {"untied": tiny_model_dir, "tied": tiny_tied_model_dir}
    cfg = CFG.model_copy(update={"engine": request.param})
    try:
        workers = {
            kind: RolloutWorker.options(num_cpus=1).remote(str(path), cfg, "float32", 0)
            for kind, path in dirs.items()
        }
        ray.get([worker.ready.remote() for worker in workers.values()])
        yield {
            kind: Rollout(workers[kind], AutoModelForCausalLM.from_pretrained(path), path)
            for kind, path in dirs.items()
        }
    finally:
        ray.shutdown()


def _hf_logprobs(
    model: PreTrainedModel, seq: list[int], start: int, temperature: float
) -> torch.Tensor:
    """log softmax(logits / T) of seq[start:] given its prefix: [len(seq) - start]."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, start - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]


def _score_gap(rollout: Rollout, sequences: list[list[int]], starts: list[int]) -> float:
    """Max |vLLM - transformers| temperature-1 log-prob over all scored tokens."""
    scores = ray.get(rollout.worker.score.remote(sequences, starts))
    return max(
        (torch.tensor(got) - _hf_logprobs(rollout.hf, seq, start, 1.0)).abs().max().item()
        for got, seq, start in zip(scores, sequences, starts, strict=True)
    )


def test_generate_returns_n_samples_per_prompt_in_group_order(rollouts: dict[str, Rollout]) -> None:
    rollout = rollouts["untied"]
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=6, seed=1)
    samples = ray.get(
        rollout.worker.generate.remote(fresh_samples(PROMPTS, 4, [10, 11, 12]), params)
    )
    tokenizer = AutoTokenizer.from_pretrained(rollout.model_dir)
    assert [s.group_id for s in samples] == [10] * 4 + [11] * 4 + [12] * 4
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(4)]
    for sample in samples:
        assert 1 <= len(sample.response_ids) <= 6
        assert len(sample.logprobs) == len(sample.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in sample.logprobs)
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "length":
            assert len(sample.response_ids) == 6
        else:
            assert sample.response_ids[-1] == tokenizer.eos_token_id
        assert sample.token_versions == [0] * len(sample.response_ids)
        assert sample.response_text == tokenizer.decode(
            sample.response_ids, skip_special_tokens=True
        )
    assert len({tuple(s.response_ids) for s in samples}) > 1


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_behaviour_logprobs_match_transformers_at_temperature(
    rollouts: dict[str, Rollout], kind: str
) -> None:
    rollout = rollouts[kind]
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=8, seed=2)
    samples = ray.get(rollout.worker.generate.remote(fresh_samples(PROMPTS, 2, [0, 1, 2]), params))
    for s in samples:
        expected = _hf_logprobs(
            rollout.hf, s.prompt_ids + s.response_ids, len(s.prompt_ids), TEMPERATURE
        )
        assert (torch.tensor(s.logprobs) - expected).abs().max().item() < 1e-4


def test_seeded_sampling_reproduces_however_prompts_are_split(rollouts: dict[str, Rollout]) -> None:
    worker = rollouts["untied"].worker
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7)
    both = ray.get(worker.generate.remote(fresh_samples(PROMPTS[:2], 3, [0, 1]), params))
    again = ray.get(worker.generate.remote(fresh_samples(PROMPTS[:2], 3, [0, 1]), params))
    second_alone = ray.get(worker.generate.remote(fresh_samples(PROMPTS[1:2], 3, [1]), params))
    assert [s.response_ids for s in both] == [s.response_ids for s in again]
    assert [s.response_ids for s in both[3:]] == [s.response_ids for s in second_alone]
    reseeded = ray.get(
        worker.generate.remote(fresh_samples(PROMPTS[:2], 3, [0, 1]), replace(params, seed=8))
    )
    assert [s.response_ids for s in reseeded] != [s.response_ids for s in both]


def test_seeded_batch_larger_than_one_prefill_step(rollouts: dict[str, Rollout]) -> None:
    """More prompt tokens than vLLM schedules per step: a chunked seeded prefill crashes on CPU."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 250, (48, 100), generator=generator).tolist()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=2, seed=3)
    worker = rollouts["untied"].worker
    first = ray.get(worker.generate.remote(fresh_samples(prompts, 2, list(range(48))), params))
    again = ray.get(worker.generate.remote(fresh_samples(prompts, 2, list(range(48))), params))
    assert len(first) == 96
    assert [s.response_ids for s in first] == [s.response_ids for s in again]


def test_greedy_matches_transformers_argmax(rollouts: dict[str, Rollout]) -> None:
    rollout = rollouts["tied"]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=5)
    samples = ray.get(rollout.worker.generate.remote(fresh_samples(PROMPTS, 1, [0, 1, 2]), params))
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(len(sample.response_ids)):
                seq.append(int(rollout.hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert sample.response_ids == seq[len(prompt) :]


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_score_matches_transformers_logprobs_from_any_start(
    rollouts: dict[str, Rollout], kind: str
) -> None:
    generator = torch.Generator().manual_seed(1)
    sequences = torch.randint(4, 250, (4, 24), generator=generator).tolist()
    assert _score_gap(rollouts[kind], sequences, starts=[1, 5, 12, 23]) < 1e-4


def test_a_start_the_engine_refuses_fails_the_workers_poll_within_seconds(
    rollouts: dict[str, Rollout],
) -> None:
    """`start` is fire and forget: the engine's error reaches the driver through the poll it
    has outstanding, instead of leaving that poll waiting for batches that never finish."""
    worker = rollouts["untied"].worker
    polled = worker.poll.remote()
    too_long = [[5] * (CFG.max_model_len + 1)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0)
    worker.start.remote({7: fresh_samples(too_long, 1, [7])}, params)
    with pytest.raises(ValueError, match="max_model_len"):
        ray.get(polled, timeout=30)
    # The worker serves new work afterwards.
    assert len(ray.get(worker.generate.remote(fresh_samples(PROMPTS, 1, [0, 1, 2]), params))) == 3
