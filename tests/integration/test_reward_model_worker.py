"""The reward model on real Ray: RewardModelWorker's scores equal a direct transformers
forward of the same texts, across batches with padding, alone and inside RewardScorer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.qwen2 import Qwen2ForSequenceClassification

from rl.config import BaseBuildConfig, RewardConfig, RewardTermConfig
from rl.rewards import RewardScorer
from rl.rewards.model import RewardModel
from rl.rewards.model_worker import RewardModelWorker
from rl.tasks import get_task
from trainer.hf_model import new_qwen2, save_hf_atomic, train_tokenizer

pytestmark = pytest.mark.integration

BATCH_SIZE = 3
PROMPTS = ["12+34=", "7+8=", "100+200=", "1+1=", "999+1=", "5+5=", "31+41=", "2+2="]
RESPONSES = ["46", "15 is the sum", "300", "2", "1000, carrying twice", "10", "72", "5"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 reward model (num_labels=1) whose config has no pad_token_id."""
    base = BaseBuildConfig(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        intermediate_size=128,
    )  # fmt: skip
    corpus = [f"{a}+{b}={a + b}" for a in range(0, 1000, 37) for b in range(0, 1000, 53)]
    tokenizer = train_tokenizer(corpus, base.vocab_size)
    config = new_qwen2(base, tokenizer, seed=0).config
    config.num_labels = 1
    config.pad_token_id = None  # RewardModel must set it, or padded rows read a pad token
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    # A unit-scale head, so that reading the wrong token changes scores by far more than 1e-5.
    torch.nn.init.normal_(model.score.weight, std=1.0)
    return save_hf_atomic(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny-rm")


def _direct_scores(path: Path, prompts: list[str], responses: list[str]) -> list[float]:
    """One unpadded transformers forward per text."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            ids = tokenizer(prompt + response, return_tensors="pt").input_ids
            scores.append(model(ids).logits[0, 0].item())
    return scores


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_plain_class_matches_transformers(reward_model_dir: Path) -> None:
    expected = _direct_scores(reward_model_dir, PROMPTS, RESPONSES)
    rm = RewardModel(str(reward_model_dir), BATCH_SIZE)
    assert rm.model.config.pad_token_id == rm.tokenizer.pad_token_id
    torch.testing.assert_close(rm.score(PROMPTS, RESPONSES), expected, rtol=0, atol=1e-5)
    # Texts of different lengths share batches: padding must not move the pooled token.
    lengths = {len(rm.tokenizer(p + r).input_ids) for p, r in zip(PROMPTS, RESPONSES, strict=True)}
    assert len(lengths) > 3


def test_actor_matches_transformers(reward_model_dir: Path, local_ray: None) -> None:
    expected = _direct_scores(reward_model_dir, PROMPTS, RESPONSES)
    worker = RewardModelWorker.options(num_cpus=1).remote(str(reward_model_dir), BATCH_SIZE)
    try:
        assert ray.get(worker.ready.remote()) == "cpu"
        scores = ray.get(worker.score.remote(PROMPTS, RESPONSES))
    finally:
        ray.kill(worker)
    assert len(scores) == len(PROMPTS) > BATCH_SIZE
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)


def test_scorer_with_model_term(reward_model_dir: Path, local_ray: None) -> None:
    expected = torch.tensor(_direct_scores(reward_model_dir, PROMPTS, RESPONSES))
    terms = [
        RewardTermConfig(name=f"model:{reward_model_dir}", weight=0.5),
        RewardTermConfig(name="arithmetic", weight=2.0),
    ]
    cfg = RewardConfig(terms=terms, model_batch_size=BATCH_SIZE, num_processes=1)
    examples = [{"answer": "46"}] + [{"answer": "x"}] * (len(PROMPTS) - 1)
    with RewardScorer(cfg, get_task("addition"), model_options={"num_cpus": 1}) as scorer:
        rewards, metrics = scorer.score(PROMPTS, RESPONSES, examples)
    right = torch.tensor([1.0] + [0.0] * (len(PROMPTS) - 1))
    torch.testing.assert_close(rewards, 0.5 * expected + 2.0 * right, rtol=0, atol=1e-5)
    assert metrics["reward/model_tiny_rm_mean"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert metrics["reward/arithmetic_mean"] == pytest.approx(1 / len(PROMPTS))
