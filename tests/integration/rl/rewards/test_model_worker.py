"""The reward model on real Ray: RewardModelWorker's scores equal a direct transformers
forward of the same texts, across batches with padding, alone and inside RewardScorer; inside
RewardScorer an actor that dies is replaced and its call retried, then the run stops loudly."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.actor import ActorClass, ActorHandle
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.qwen2 import Qwen2ForSequenceClassification

from rl.config import BaseBuildConfig, RewardConfig, RewardTermConfig
from rl.data.tasks import get_task
from rl.rewards import RewardScorer
from rl.rewards import scorer as scorer_module
from rl.rewards.model import RewardModel
from rl.rewards.model_worker import RewardModelWorker
from trainer.hf_model import new_model, save_hf_atomic, train_tokenizer

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
    config = new_model(base, tokenizer, seed=0).config
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
    # Accuracy is a verifier's: a reward model's scores have no "right" threshold.
    assert metrics["reward/arithmetic_accuracy"] == pytest.approx(1 / len(PROMPTS))
    assert "reward/model_tiny_rm_accuracy" not in metrics


def _kill_and_wait(actor: ActorHandle) -> None:
    """Kill `actor` and return once a call to it fails: ray.kill returns before the process is
    gone, and a call made at once could still be answered."""
    ray.kill(actor)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers after 60 s")


def _stand_in_worker(on_score: str) -> ActorClass:
    """A RewardModelWorker stand-in that starts at once and, on every `score` call, either exits
    its process ("die": the actor dies) or raises ValueError ("raise": a bug in model code)."""

    # Defined here, not at module level: Ray's workers cannot import this test module, and a
    # local class is pickled by value.
    class StandIn:
        def __init__(self, path: str, batch_size: int) -> None:
            pass

        def ready(self) -> str:
            return "cpu"

        def score(self, prompts: list[str], responses: list[str]) -> list[float]:
            if on_score == "die":
                os._exit(1)
            raise ValueError("a bug in the reward model's code")

    return ray.remote(StandIn)


def _model_only_config(path: Path) -> RewardConfig:
    terms = [RewardTermConfig(name=f"model:{path}", weight=1.0)]
    return RewardConfig(terms=terms, model_batch_size=BATCH_SIZE, num_processes=1)


def test_scorer_replaces_a_dead_model_actor(reward_model_dir: Path, local_ray: None) -> None:
    cfg = _model_only_config(reward_model_dir)
    examples = [{"answer": "x"}] * len(PROMPTS)
    options = {"num_cpus": 1}
    with RewardScorer(cfg, get_task("addition"), options, retries=2) as scorer:
        before, metrics = scorer.score(PROMPTS, RESPONSES, examples)
        assert metrics["reward/model_actor_errors"] == 0
        first = scorer._models[0].actor
        _kill_and_wait(first)
        after, metrics = scorer.score(PROMPTS, RESPONSES, examples)
        assert metrics["reward/model_actor_errors"] == 1
        assert scorer._models[0].actor is not first
        # The replacement keeps scoring later batches without another restart.
        _, metrics = scorer.score(PROMPTS, RESPONSES, examples)
        assert metrics["reward/model_actor_errors"] == 0
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    expected = torch.tensor(_direct_scores(reward_model_dir, PROMPTS, RESPONSES))
    torch.testing.assert_close(after, expected.float(), rtol=0, atol=1e-5)


def test_scorer_stops_when_the_actor_keeps_dying(
    reward_model_dir: Path, local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scorer_module, "RewardModelWorker", _stand_in_worker("die"))
    cfg = _model_only_config(reward_model_dir)
    examples = [{"answer": "x"}] * len(PROMPTS)
    with RewardScorer(cfg, get_task("addition"), {"num_cpus": 1}, retries=2) as scorer:
        with pytest.raises(RuntimeError) as info:
            scorer.score(PROMPTS, RESPONSES, examples)
    message = str(info.value)
    assert f"reward term 'model:{reward_model_dir}'" in message
    assert "died 3 times scoring one batch" in message
    assert "the run stops" in message
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)


def test_scorer_does_not_retry_errors_of_the_model_code(
    reward_model_dir: Path, local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scorer_module, "RewardModelWorker", _stand_in_worker("raise"))
    cfg = _model_only_config(reward_model_dir)
    examples = [{"answer": "x"}] * len(PROMPTS)
    with RewardScorer(cfg, get_task("addition"), {"num_cpus": 1}, retries=2) as scorer:
        actor = scorer._models[0].actor
        with pytest.raises(ValueError, match="a bug in the reward model's code"):
            scorer.score(PROMPTS, RESPONSES, examples)
        assert scorer._models[0].actor is actor  # not replaced
        assert ray.get(actor.ready.remote()) == "cpu"  # and still alive
