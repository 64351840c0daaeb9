"""From samples to a training step: reward shaping, model annotations and the batch's order of
operations (proximal log-probs, KL penalty, advantages, off-policy weights).

The reward scorer and trainer group are small fakes: what is tested is the driver-side logic
that decides with which tensors each sample trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rl.agents.environment import ToolUse
from rl.algorithms.off_policy import proximal_from_forward, recomputes_old_logprobs
from rl.config import Config
from rl.run import experience
from rl.run.experience import (
    KLController,
    StreamingScorer,
    TrainerSide,
    annotate_samples,
    prepare_batch,
)
from rl.types import Batch, Episode, Sample

GROUP = 2


def _config(trainer: dict | None = None, scheduler: dict | None = None, **algorithm) -> Config:
    return Config.model_validate(
        {
            "model": {"path": "unused"},
            "rollout": {"max_new_tokens": 4},
            "algorithm": {"group_size": GROUP, **algorithm},
            "trainer": trainer or {},
            "scheduler": scheduler or {},
            "run": {"prompts_per_step": 2},
        }
    )


def _samples() -> list[Sample]:
    return [
        Sample([1, 2], 0, 0, response_ids=[3, 4], logprobs=[-0.5, -0.5], token_versions=[0, 0]),
        Sample([1, 2], 0, 1, response_ids=[3], logprobs=[-0.5], token_versions=[0]),
    ]


class _RewardScorer:
    def score(self, prompts, responses, examples):
        return torch.zeros(len(responses)), {"reward/errors": 0.0}

    def close(self) -> None:
        pass


def test_overlong_shaping_penalises_responses_in_the_buffer() -> None:
    # max_new_tokens 4, buffer 3: 1 token is free, 2 tokens cost 1/3 of the penalty.
    cfg = _config(overlong_buffer=3, overlong_penalty=0.9)
    scorer = StreamingScorer(cfg, _RewardScorer())
    try:
        groups = [(_samples(), {"prompt": "p"}), (_samples()[1:], {"prompt": "q"})]
        scores, metrics = scorer.score(groups).result(timeout=10)
    finally:
        scorer.close()
    assert scores == [pytest.approx([-0.3, 0.0]), pytest.approx([0.0])]
    assert metrics == {"reward/errors": 0.0, "reward/truncated_capped": 0.0}


class _ExactAnswer:
    """The task's reward: 1 for the example's answer, else 0."""

    def score(self, prompts, responses, examples):
        right = [float(r == e["answer"]) for r, e in zip(responses, examples, strict=True)]
        return torch.tensor(right), {}

    def close(self) -> None:
        pass


def _episode_sample(
    index: int, answer: str, env_reward: float, finish_reason: str, max_turns: bool = False
) -> Sample:
    episode = Episode(ToolUse(), [], None, reward=env_reward, max_turns_reached=max_turns)
    return Sample(
        [1], 0, index, response_ids=[3], logprobs=[-0.5], finish_reason=finish_reason,
        response_text=answer, episode=episode,
    )  # fmt: skip


def _score_one_group(samples: list[Sample], **reward) -> tuple[list[float], dict]:
    cfg = Config.model_validate(
        {"model": {"path": "unused"}, "algorithm": {"group_size": len(samples)}, "reward": reward}
    )
    scorer = StreamingScorer(cfg, _ExactAnswer())
    try:
        (scores,), metrics = scorer.score([(samples, {"prompt": "p", "answer": "cat"})]).result(10)
    finally:
        scorer.close()
    return scores, metrics


def _guess_the_word_group() -> list[Sample]:
    """docs/agents.md's old example environment: -0.1 for a wrong first answer, then a hint."""
    return [
        _episode_sample(0, "cat", 0.0, "stop"),  # right at once: 1
        _episode_sample(1, "cow", -0.1, "stop"),  # wrong twice: -0.1
        _episode_sample(2, "the word might be", 0.0, "length"),  # rambled into the limit: 0
        _episode_sample(3, "<tool_call>", 0.0, "stop", max_turns=True),  # calls until max_turns
        _episode_sample(4, "it is c", -0.1, "length"),  # a hint, then cut: -0.1 already
    ]


def test_an_episode_cut_by_a_limit_scores_no_higher_than_a_wrong_answer() -> None:
    scores, metrics = _score_one_group(_guess_the_word_group())
    # Truncated ones are capped at the lowest finished score, the wrong answer's -0.1.
    assert scores == pytest.approx([1.0, -0.1, -0.1, -0.1, -0.1])
    assert metrics["reward/truncated_capped"] == pytest.approx(2 / 5)


def test_without_the_cap_a_truncated_episode_keeps_its_own_score() -> None:
    scores, metrics = _score_one_group(_guess_the_word_group(), cap_truncated=False)
    assert scores == pytest.approx([1.0, -0.1, 0.0, 0.0, -0.1])
    assert "reward/truncated_capped" not in metrics


def test_a_group_cut_short_everywhere_keeps_its_scores() -> None:
    group = [
        _episode_sample(0, "the word", 0.0, "length"),
        _episode_sample(1, "cat", -0.1, "length"),  # a hint, then the answer, cut: 0.9
        _episode_sample(2, "<tool_call>", 0.0, "stop", max_turns=True),
    ]
    scores, metrics = _score_one_group(group)
    assert scores == pytest.approx([0.0, 0.9, 0.0])
    assert metrics["reward/truncated_capped"] == 0.0


def test_a_single_turn_response_cut_at_max_new_tokens_is_capped_too() -> None:
    group = [
        Sample([1], 0, 0, response_ids=[3], finish_reason="stop", response_text="dog"),
        Sample([1], 0, 1, response_ids=[3], finish_reason="length", response_text="cat"),
    ]
    # The cut response happens to hold the answer (1), yet it did not finish: the group's
    # finished wrong answer (0) caps it.
    scores, _ = _score_one_group(group)
    assert scores == pytest.approx([0.0, 0.0])


class _Trainers:
    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.calls: list[str] = []

    def compute_logprobs(self, batch, model: str = "policy") -> torch.Tensor:
        self.calls.append(model)
        offset = self.shift if model == "policy" else 2 * self.shift
        return (batch.behaviour_logprobs + offset) * batch.loss_mask


def test_annotation_fills_each_samples_response_tokens_only() -> None:
    cfg = _config(recompute_old_logprobs=True, kl_coef=0.1)
    trainers = _Trainers(shift=1.0)
    samples = annotate_samples(cfg, _samples(), 0, trainers, None)
    assert trainers.calls == ["policy", "reference"]
    assert [s.old_logprobs for s in samples] == [[0.5, 0.5], [0.5]]
    assert [s.ref_logprobs for s in samples] == [[1.5, 1.5], [1.5]]
    assert all(s.values is None for s in samples)


def _segmented() -> list[Sample]:
    """Sample 0 is an agent function's episode that broke its prefix once: an earlier segment
    of its own prompt and two sampled tokens around an observation."""
    samples = _samples()
    episode = Episode(None, [], None, example={})
    episode.segments = [
        Sample(
            [7, 8, 9], 0, 0, [5, 6, 7], [-0.25, 0.0, -0.75], [0, -1, 0], "stop", loss_mask=[1, 0, 1]
        )
    ]
    samples[0].episode, samples[0].loss_mask = episode, [1, 1]
    return samples


def test_an_episodes_earlier_segments_are_annotated_too() -> None:
    cfg = _config(recompute_old_logprobs=True, kl_coef=0.1)
    samples = annotate_samples(cfg, _segmented(), 0, _Trainers(shift=1.0), None)
    segment = samples[0].episode.segments[0]
    assert segment.old_logprobs == [0.75, 0.0, 0.25]  # sampled tokens shifted, the rest 0
    assert segment.ref_logprobs == [1.75, 0.0, 1.25]


def test_an_episodes_earlier_segment_trains_as_a_row_with_the_episodes_advantage() -> None:
    cfg = _config()
    batch, critic_batch, _ = prepare_batch(cfg, _segmented(), [1.0, 0.0], 0, 0.0)
    # GRPO over the group's two episodes, by its formula: (s - mean) / (unbiased std + 1e-6).
    scores = torch.tensor([1.0, 0.0])
    expected = ((scores - scores.mean()) / (scores.std() + 1e-6))[0].item()
    assert batch.num_sequences == 3 and critic_batch.num_sequences == 2
    # The segment's row: prompt [7, 8, 9], response [5, 6, 7]; its targets 2..4.
    assert batch.input_ids[2].tolist() == [7, 8, 9, 5, 6, 7]
    assert batch.loss_mask[2].tolist() == [0, 0, 1, 0, 1]
    assert batch.advantages[2].tolist() == pytest.approx([0, 0, expected, 0, expected])
    assert batch.behaviour_logprobs[2, 2:].tolist() == [-0.25, 0.0, -0.75]
    assert batch.advantages[0, 1:3].tolist() == pytest.approx([expected, expected])


def test_under_a_critic_an_episodes_earlier_segments_are_not_trained() -> None:
    samples = _segmented()
    for sample in [*samples, *samples[0].episode.segments]:
        sample.values = [0.0] * len(sample.response_ids)
    cfg = _config(advantage="gae")
    batch, _, _ = prepare_batch(cfg, samples, [1.0, 0.0], 0, 0.0)
    assert batch.num_sequences == 2


def test_a_recomputed_proximal_policy_weighs_behaviour_against_it() -> None:
    cfg = _config(recompute_old_logprobs=True, off_policy="token-tis", is_cap=1.5)
    samples = annotate_samples(cfg, _samples(), 0, _Trainers(shift=1.0), None)
    batch, _, metrics = prepare_batch(cfg, samples, [1.0, 0.0], 0, cfg.algorithm.kl_coef)
    assert metrics["off_policy/max_abs_logprob_gap"] == pytest.approx(1.0)
    # exp(1) > 1.5: every response token's weight is truncated at the cap.
    assert batch.is_weights[batch.loss_mask.bool()].tolist() == pytest.approx([1.5] * 3)
    assert batch.advantages[0].abs().sum() > 0


def test_a_recomputed_proximal_policy_reports_the_mismatch_per_sample_age() -> None:
    # Step 3 trains version 2: sample 0 (version 2) is 0 versions old, sample 1 (version 1) 1.
    cfg = _config(recompute_old_logprobs=True, off_policy="token-mis", is_low=0.5, is_high=2.0)
    samples = _samples()
    samples[0].token_versions, samples[1].token_versions = [2, 2], [1]
    # Behaviour -0.5 everywhere; d = proximal - behaviour = [0.25, 1.0] and [-0.5].
    samples[0].old_logprobs, samples[1].old_logprobs = [-0.25, 0.5], [-1.0]
    _, _, metrics = prepare_batch(cfg, samples, [1.0, 0.0], 0, 0.0, step=3)

    def k3(d: float) -> float:
        return math.exp(d) - 1 - d

    # k1 = behav - prox = -d; token-mis drops sample 0's second token (e^1 > is_high).
    expected = {
        "mismatch_k1": -(0.25 + 1.0 - 0.5) / 3,
        "mismatch_k3": (k3(0.25) + k3(1.0) + k3(-0.5)) / 3,
        "kept_token_frac": 2 / 3,
        "kept_seq_frac": 1 / 2,
        "mismatch_k1_age0": -(0.25 + 1.0) / 2,
        "mismatch_k3_age0": (k3(0.25) + k3(1.0)) / 2,
        "kept_token_frac_age0": 1 / 2,
        "kept_seq_frac_age0": 0.0,
        "mismatch_k1_age1": 0.5,
        "mismatch_k3_age1": k3(-0.5),
        "kept_token_frac_age1": 1.0,
        "kept_seq_frac_age1": 1.0,
    }
    got = {k.removeprefix("off_policy/"): v for k, v in metrics.items() if "_k" in k or "kept" in k}
    assert got == pytest.approx(expected)


def test_kl_in_reward_lowers_returns_and_adapts_the_coefficient() -> None:
    cfg = _config(
        kl_coef=0.1,
        kl_in_reward=True,
        kl_estimator="k1",
        kl_target=0.01,
        advantage="reinforce_pp_baseline",
    )
    trainers = _Trainers(shift=0.5)
    samples = annotate_samples(cfg, _samples(), 0, trainers, None)
    assert trainers.calls == ["reference"]
    controller = KLController(cfg.algorithm)
    batch, _, metrics = prepare_batch(cfg, samples, [1.0, 1.0], 0, controller.coef)
    # k1 = old - ref per token: old is behaviour (-0.5), ref is behaviour + 1.0.
    assert metrics["kl/reward_penalty"] == pytest.approx((2 * -1.0 + 1 * -1.0) / 2)
    assert metrics["kl/coef"] == 0.1
    controller.adapt(metrics, batch.num_sequences)
    assert controller.coef != 0.1
    # Equal scores, but the longer response pays more KL: the baseline no longer hides it.
    assert batch.advantages[0, 2].item() != 0.0


def test_a_keep_all_correction_takes_the_proximal_policy_from_the_training_forward() -> None:
    cfg = _config(off_policy="token-tis")
    # One optimizer step per batch: the training forward is the proximal policy, no extra pass.
    assert proximal_from_forward(cfg) and not recomputes_old_logprobs(cfg)
    assert not recomputes_old_logprobs(_config())  # none: PPO's ratio is against behaviour


@pytest.mark.parametrize(
    "reason, cfg",
    [
        ("two optimizer steps per batch", _config({"num_mini_batches": 2}, off_policy="token-tis")),
        ("a correction that drops tokens", _config(off_policy="token-mis")),
        ("KL in the reward", _config(off_policy="seq-tis", kl_coef=0.1, kl_in_reward=True)),
    ],
)
def test_a_separate_pass_recomputes_the_proximal_policy_when_the_forward_cannot(
    reason: str, cfg: Config
) -> None:
    assert not proximal_from_forward(cfg), reason
    assert recomputes_old_logprobs(cfg), reason


def test_with_the_proximal_from_the_forward_the_batch_carries_no_weights() -> None:
    cfg = _config(scheduler={"max_staleness": 1}, off_policy="token-tis")
    batch, _, metrics = prepare_batch(cfg, _samples(), [1.0, 0.0], 0, cfg.algorithm.kl_coef)
    assert batch.is_weights is None and "off_policy/weight_mean" not in metrics
    assert torch.equal(batch.old_logprobs, batch.behaviour_logprobs)


class _Ranks:
    """Trainer or critic ranks that record the batch they train on."""

    device_name = "cpu"

    def __init__(self) -> None:
        self.trained: list[Batch] = []

    def train_step(self, batch: Batch) -> dict[str, float]:
        self.trained.append(batch)
        return {"timing/train_tokens_per_s": 1.0}


def test_under_token_mis_the_critic_trains_on_every_response_token_and_the_policy_on_the_kept(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")  # no shape: no MFU
    cfg = _config(advantage="gae", off_policy="token-mis", is_low=0.5, is_high=2.0)
    cfg.model.path = str(tmp_path)
    samples = _samples()
    # Proximal against behaviour (-0.5): sample 0's second token has ratio exp(1.5) > is_high.
    samples[0].old_logprobs, samples[1].old_logprobs = [-0.5, 1.0], [-0.5]
    samples[0].values, samples[1].values = [0.1, 0.2], [0.3]
    policy, critic = _Ranks(), _Ranks()
    side = TrainerSide(cfg, policy, critic, weight_sync=None, pad_id=0)
    try:
        side.train(1, samples, [1.0, 0.0]).result(timeout=30)
    finally:
        side.close()
    # Rows [1, 2, 3, 4] and [1, 2, 3, pad]: targets 3 and 4, and 3, are the responses.
    response = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert torch.equal(critic.trained[0].loss_mask, response)
    assert torch.equal(
        policy.trained[0].loss_mask, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    )
    assert critic.trained[0].is_weights is None


def test_mfu_is_the_batchs_model_flops_a_token_times_the_tokens_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = _config()
    cfg.model.path = str(tmp_path)
    batches: list[list[float]] = []

    def train_flops(shape: object, lengths: list[float]) -> float:
        batches.append(lengths)
        return 14e12

    monkeypatch.setattr(experience, "train_flops", train_flops)
    side = TrainerSide(cfg, _Ranks(), None, weight_sync=None, pad_id=0)
    try:
        metrics = side.train(1, _samples(), [1.0, 0.0]).result(timeout=30)
    finally:
        side.close()
    assert batches == [[4, 3]]  # prompt and response tokens of each sample
    assert metrics["perf/train_tflops"] == 2.0  # 14e12 FLOPs over 7 tokens, at 1 token/s


class _Teacher:
    """A teacher whose log-prob of every token is 0.25 below the behaviour's (0 off the
    sampled tokens, as the real one's is at padding)."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        self.batches.append(batch)
        return (batch.behaviour_logprobs - 0.25) * batch.loss_mask


def test_the_teacher_scores_every_sample_and_an_episodes_earlier_segments() -> None:
    cfg = _config(distill_coef=1.0)
    trainers, teacher = _Trainers(shift=1.0), _Teacher()
    samples = annotate_samples(cfg, _segmented(), 0, trainers, None, teacher)
    assert trainers.calls == []  # no proximal pass, no reference: the teacher alone
    assert len(teacher.batches) == 1 and teacher.batches[0].num_sequences == 3
    assert [s.teacher_logprobs for s in samples] == [[-0.75, -0.75], [-0.75]]
    assert samples[0].episode.segments[0].teacher_logprobs == [-0.5, 0.0, -1.0]
    assert all(s.ref_logprobs is None and s.old_logprobs is None for s in samples)


def test_distillation_adds_teacher_minus_behaviour_to_each_sampled_tokens_task_advantage() -> None:
    cfg = _config(distill_coef=0.5)
    samples = _segmented()
    # Behaviour: -0.5 on the samples' tokens; the segment's [-0.25, (inserted) 0.0, -0.75].
    samples[0].teacher_logprobs, samples[1].teacher_logprobs = [-0.1, -2.5], [-0.5]
    segment = samples[0].episode.segments[0]
    segment.teacher_logprobs = [-1.25, 7.0, -0.5]  # the inserted token's is never used
    batch, critic_batch, metrics = prepare_batch(cfg, samples, [1.0, 0.0], 0, 0.0)
    # GRPO over the two episodes' scores, then 0.5 (teacher - behaviour) on every sampled token.
    scores = torch.tensor([1.0, 0.0])
    grpo = ((scores - scores.mean()) / (scores.std() + 1e-6)).tolist()
    assert batch.advantages[0, 1:3].tolist() == pytest.approx(
        [grpo[0] + 0.5 * (-0.1 + 0.5), grpo[0] + 0.5 * (-2.5 + 0.5)]
    )
    assert batch.advantages[1, 1].item() == pytest.approx(grpo[1])  # the teacher agrees
    assert batch.advantages[2, 2:5].tolist() == pytest.approx(
        [grpo[0] + 0.5 * (-1.25 + 0.25), 0.0, grpo[0] + 0.5 * (-0.5 + 0.75)]
    )
    assert batch.advantages[batch.loss_mask == 0].abs().sum() == 0
    # behaviour - teacher over the five sampled tokens.
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.4 + 2.0 + 0.0 + 1.0 - 0.25) / 5)
    # The critic's targets do not change: its batch keeps the task's advantages.
    assert critic_batch.advantages[0, 1:3].tolist() == pytest.approx([grpo[0], grpo[0]])


def test_with_the_task_rewards_weight_zero_the_advantage_is_the_teachers_alone() -> None:
    """Pure distillation: every score 0, so GRPO's group advantage is exactly 0."""
    cfg = _config(distill_coef=1.0)
    samples = _samples()
    samples[0].teacher_logprobs, samples[1].teacher_logprobs = [-0.1, -2.5], [-3.0]
    batch, _, _ = prepare_batch(cfg, samples, [0.0, 0.0], 0, 0.0)
    assert batch.advantages.flatten().tolist() == pytest.approx([0, 0.4, -2.0, 0, -2.5, 0])


def test_a_trainer_side_with_a_teacher_annotates_its_steps(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # no shape: no MFU
    cfg = _config(distill_coef=1.0)
    cfg.model.path = str(tmp_path)
    side = TrainerSide(cfg, _Ranks(), None, None, 0, teacher=_Teacher())
    try:
        assert side.needs_annotation
    finally:
        side.close()
