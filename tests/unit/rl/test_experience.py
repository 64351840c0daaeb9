"""Rollout collection (dynamic sampling, overlong shaping) and batch annotation order.

The rollout group, reward scorer and trainer group are replaced by small fakes: what is
tested is the driver-side logic that decides which samples train and with what tensors.
"""

from __future__ import annotations

import pytest
import torch

from rl.batching import build_batch
from rl.config import Config
from rl.data import PromptStream
from rl.experience import KLController, annotate_batch, collect_rollouts
from rl.types import Sample, SamplingParams

GROUP = 2


class _Tokenizer:
    chat_template = None
    name_or_path = "fake"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class _Rollout:
    """Responses of 1..2 tokens whose text is the prompt's answer or a wrong one, in turn."""

    def __init__(self) -> None:
        self.num_calls = 0

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, policy_version: int
    ) -> list[Sample]:
        self.num_calls += 1
        return [
            Sample(
                prompt_ids=prompt,
                response_ids=[7] * (1 + i % 2),
                logprobs=[-0.5] * (1 + i % 2),
                finish_reason="stop",
                policy_version=policy_version,
                group_id=group,
                response_text="right" if i % 2 else "wrong",
            )
            for group, prompt in enumerate(prompts)
            for i in range(params.n)
        ]


class _Scorer:
    """Prompts named 'mixed' get one right answer per group; 'same' prompts score all 0."""

    def score(self, prompts, responses, examples):
        scores = [
            float(ex["prompt"] == "mixed" and text == "right")
            for text, ex in zip(responses, examples, strict=True)
        ]
        return torch.tensor(scores), {"reward/errors": 1.0, "reward/task_mean": 0.5}


def _config(**algorithm) -> Config:
    return Config.model_validate(
        {
            "model": {"path": "unused"},
            "rollout": {"max_new_tokens": 4},
            "algorithm": {"group_size": GROUP, **algorithm},
            "run": {"prompts_per_step": 2},
        }
    )


def _collect(cfg: Config, prompts: list[str]):
    stream = PromptStream([{"prompt": p, "answer": "x"} for p in prompts], seed=0)
    rollout = _Rollout()
    sampling = SamplingParams(n=GROUP, max_new_tokens=cfg.rollout.max_new_tokens)
    result = collect_rollouts(cfg, rollout, _Scorer(), stream, _Tokenizer(), sampling, version=3)
    return result, rollout.num_calls


def test_without_dynamic_sampling_every_group_trains() -> None:
    rollouts, num_calls = _collect(_config(), ["same", "same", "mixed"])
    assert num_calls == 1 and len(rollouts.samples) == 2 * GROUP
    assert rollouts.metrics["rollout/kept_groups"] == 2
    assert all(s.policy_version == 3 for s in rollouts.samples)


def test_dynamic_sampling_replaces_groups_without_signal_up_to_the_round_limit() -> None:
    # Each round draws 2 prompts; only 'mixed' groups are kept.
    prompts = ["same", "mixed", "same", "same", "mixed", "same"]
    cfg = _config(dynamic_sampling=True, max_sampling_rounds=3)
    stream_order = PromptStream([{"prompt": p} for p in prompts], seed=0).next_batch(6)
    num_mixed = sum(ex["prompt"] == "mixed" for ex in stream_order)
    rollouts, num_calls = _collect(cfg, prompts)
    assert num_calls == 3  # never enough: the round limit stops it
    assert len(rollouts.samples) == num_mixed * GROUP
    assert rollouts.metrics["rollout/sampling_rounds"] == 3
    assert rollouts.metrics["rollout/generated_samples"] == 6 * GROUP
    assert rollouts.metrics["reward/errors"] == 3.0  # counts add up over rounds
    for group in range(num_mixed):
        assert sorted(rollouts.scores[group * GROUP : (group + 1) * GROUP]) == [0.0, 1.0]


def test_dynamic_sampling_stops_once_the_batch_is_full() -> None:
    cfg = _config(dynamic_sampling=True, max_sampling_rounds=5)
    rollouts, num_calls = _collect(cfg, ["mixed"] * 4)
    assert num_calls == 1 and len(rollouts.samples) == 2 * GROUP


def test_overlong_shaping_penalises_responses_in_the_buffer() -> None:
    # max_new_tokens 4, buffer 3: 1 token is free, 2 tokens cost 1/3 of the penalty.
    cfg = _config(overlong_buffer=3, overlong_penalty=0.9)
    rollouts, _ = _collect(cfg, ["same", "same"])
    lengths = [len(s.response_ids) for s in rollouts.samples]
    expected = [0.0 if n == 1 else -0.3 for n in lengths]
    assert rollouts.scores == pytest.approx(expected)


class _Trainers:
    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.calls: list[str] = []

    def compute_logprobs(self, batch, model: str = "policy") -> torch.Tensor:
        self.calls.append(model)
        offset = self.shift if model == "policy" else 2 * self.shift
        return (batch.behaviour_logprobs + offset) * batch.loss_mask


def _batch():
    samples = [
        Sample([1, 2], [3, 4], [-0.5, -0.5], "stop", 0, group_id=0),
        Sample([1, 2], [3], [-0.5], "stop", 0, group_id=0),
    ]
    return build_batch(samples, pad_id=0)


def test_annotate_recomputes_the_proximal_policy_then_weighs_behaviour_against_it() -> None:
    cfg = _config(recompute_old_logprobs=True, off_policy="token-tis", is_cap=1.5)
    batch, trainers = _batch(), _Trainers(shift=1.0)
    metrics = annotate_batch(cfg, batch, torch.tensor([1.0, 0.0]), trainers, None, None)
    assert trainers.calls == ["policy"]
    assert metrics["off_policy/max_abs_logprob_gap"] == pytest.approx(1.0)
    # exp(1) > 1.5: every response token's weight is truncated at the cap.
    assert batch.is_weights[batch.loss_mask.bool()].tolist() == pytest.approx([1.5] * 3)
    assert batch.advantages[0].abs().sum() > 0


def test_kl_in_reward_lowers_returns_and_adapts_the_coefficient() -> None:
    cfg = _config(
        kl_coef=0.1, kl_in_reward=True, kl_estimator="k1", kl_target=0.01, advantage="rloo"
    )
    batch, trainers = _batch(), _Trainers(shift=0.5)
    controller = KLController(cfg.algorithm)
    metrics = annotate_batch(cfg, batch, torch.tensor([1.0, 1.0]), trainers, None, controller)
    assert trainers.calls == ["reference"]
    # k1 = old - ref = 0.5 - 1.0... per token: old is behaviour (-0.5), ref is behaviour + 1.0.
    assert metrics["kl/reward_penalty"] == pytest.approx((2 * -1.0 + 1 * -1.0) / 2)
    assert metrics["kl/coef"] == 0.1 and controller.coef != 0.1
    # Equal scores, but the longer response pays more KL: rloo now separates them.
    assert batch.advantages[0, 2].item() != 0.0
