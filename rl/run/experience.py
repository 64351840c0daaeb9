"""From generated samples to a training step, for the scheduler (rl.run.scheduler.loop).

`StreamingScorer` scores one group at a time (with DAPO's overlong shaping, and truncated
samples capped by their group's finished ones) off the driver's thread; `TrainerSide`
computes the model annotations a step needs (proximal, reference and teacher log-probs,
values) once its groups are in, then builds the batch (advantages, KL penalty, distillation,
off-policy weights) and trains. `prepare_batch` is the pure part, so the order of those steps can be
read, and tested, in one place.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from rl.algorithms.advantages import ADVANTAGES
from rl.algorithms.dapo import overlong_penalty
from rl.algorithms.distill import reverse_kl, with_distillation
from rl.algorithms.kl import KL_ESTIMATORS, adaptive_kl_coef
from rl.algorithms.masked import at_last_token, masked_mean
from rl.algorithms.off_policy import (
    OFF_POLICY_CORRECTIONS,
    mismatch_metrics,
    proximal_from_forward,
    recomputes_old_logprobs,
)
from rl.cluster.memory_plan import ModelShape
from rl.cluster.trainer_ranks import CriticRanks, PolicyRanks, TeacherRanks
from rl.config import AlgorithmConfig, Config
from rl.observe.flops import peak_flops, train_flops
from rl.rewards import RewardScorer
from rl.rewards.truncation import cap_truncated, is_truncated
from rl.run.batching import build_batch, per_sample, stack, with_segments
from rl.sync.weight_sync import WeightSync
from rl.types import Batch, Sample


class StreamingScorer:
    """Scores groups on one background thread, so the driver keeps dispatching meanwhile."""

    def __init__(self, cfg: Config, scorer: RewardScorer) -> None:
        self.cfg = cfg
        self.scorer = scorer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def score(self, groups: list[tuple[list[Sample], dict]]) -> Future:
        """Future of (scores per group, metrics) for (samples, example) pairs, each group's
        samples answering its example; one call to the reward functions for them all."""
        return self._thread.submit(self._score, groups)

    def _score(
        self, groups: list[tuple[list[Sample], dict]]
    ) -> tuple[list[list[float]], dict[str, float]]:
        algo = self.cfg.algorithm
        samples = [sample for group, _ in groups for sample in group]
        examples = [example for group, example in groups for _ in group]
        scores, metrics = self.scorer.score(
            [example["prompt"] for example in examples],
            [sample.response_text for sample in samples],
            examples,
        )
        # An agent's environment may reward its steps too: added to the answer's reward.
        scores = scores + torch.tensor([s.episode.reward if s.episode else 0.0 for s in samples])
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        scores = scores + overlong_penalty(
            lengths, self.cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        )
        per_group = list(scores.split([len(group) for group, _ in groups]))
        if self.cfg.reward.cap_truncated:
            capped = 0
            for k, (group, _) in enumerate(groups):
                truncated = torch.tensor([is_truncated(s) for s in group], dtype=torch.bool)
                shaped = cap_truncated(per_group[k], truncated)
                capped += int((shaped < per_group[k]).sum())
                per_group[k] = shaped
            metrics = {**metrics, "reward/truncated_capped": capped / max(len(samples), 1)}
        return [group.tolist() for group in per_group], metrics

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.scorer.close()


class KLController:
    """The KL-penalty coefficient: fixed, or adapted towards `algorithm.kl_target`."""

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.kl_coef

    def adapt(self, metrics: dict[str, float], num_samples: int) -> None:
        """After a step of `num_samples` whose prepare_batch gave `metrics`: towards kl_target
        from the KL the reward penalised, when it penalised one."""
        if self.cfg.kl_target > 0 and "kl/reward_penalty" in metrics:
            self.coef = adaptive_kl_coef(
                self.coef,
                metrics["kl/reward_penalty"],
                self.cfg.kl_target,
                num_samples,
                self.cfg.kl_horizon,
            )


def annotate_samples(
    cfg: Config,
    samples: list[Sample],
    pad_id: int,
    trainers: PolicyRanks,
    critic: CriticRanks | None,
    teacher: TeacherRanks | None = None,
) -> list[Sample]:
    """Fill each sample's proximal (when recomputed) and reference (when KL is on) log-probs,
    critic values and teacher log-probs (distillation), from the trainer side's current
    weights, its agent episode's earlier segments' too; returns `samples`."""
    returned, samples = samples, with_segments(samples)
    batch = build_batch(samples, pad_id)
    if recomputes_old_logprobs(cfg):
        for sample, values in zip(
            samples, per_sample(trainers.compute_logprobs(batch), samples), strict=True
        ):
            sample.old_logprobs = values
    if cfg.algorithm.kl_coef > 0:
        ref = trainers.compute_logprobs(batch, model="reference")
        for sample, values in zip(samples, per_sample(ref, samples), strict=True):
            sample.ref_logprobs = values
    if critic is not None:
        for sample, values in zip(
            samples, per_sample(critic.compute_values(batch), samples), strict=True
        ):
            sample.values = values
    if teacher is not None:
        for sample, values in zip(
            samples, per_sample(teacher.compute_logprobs(batch), samples), strict=True
        ):
            sample.teacher_logprobs = values
    return returned


def prepare_batch(
    cfg: Config,
    samples: list[Sample],
    scores: list[float],
    pad_id: int,
    kl_coef: float,
    step: int | None = None,
) -> tuple[Batch, Batch, dict[str, float]]:
    """The training batches of annotated `samples` with sequence rewards `scores` [B]: KL
    penalty (at `kl_coef`, KLController's for the step: "kl/reward_penalty" is what it adapts
    to), advantages, the distillation term on every sampled token of every row (an agent
    episode's earlier segments' too), then off-policy weights (measured from the proximal
    log-probs). With the `step` that trains them, the mismatch metrics are also given per
    sample age.

    Returns the policy's batch, the critic's and metrics. They differ only in what the
    off-policy correction changes: the critic's batch keeps every response token in its loss
    mask, since a value target does not depend on which policy sampled the token.
    """
    algo = cfg.algorithm
    batch = build_batch(samples, pad_id)
    metrics: dict[str, float] = {}
    # The full response mask: rewards, baselines and values cover every generated token even
    # when the off-policy correction later drops some of them from the loss.
    mask = batch.loss_mask
    if recomputes_old_logprobs(cfg):
        gap = (batch.old_logprobs - batch.behaviour_logprobs).abs() * mask
        metrics["off_policy/max_abs_logprob_gap"] = gap.max().item()
        metrics["off_policy/mean_abs_logprob_gap"] = (gap.sum() / mask.sum().clamp(min=1)).item()
    rewards = at_last_token(torch.tensor(scores), mask)
    kl_penalty = None
    if algo.kl_coef > 0 and algo.kl_in_reward:
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(batch.old_logprobs, batch.ref_logprobs) * mask
        kl_penalty = -kl_coef * kl
        metrics.update({"kl/reward_penalty": kl.sum(dim=1).mean().item(), "kl/coef": kl_coef})
    # The estimator adds the KL penalty to the task scores after any group baseline.
    batch.advantages, batch.returns = ADVANTAGES.get(algo.advantage)(
        rewards, mask, algo, batch.old_values, kl_penalty
    )
    metrics["advantage/abs_mean"] = masked_mean(batch.advantages.abs(), mask).item()
    critic_batch = batch
    segments = with_segments(samples)[len(samples) :]
    if segments and not ADVANTAGES.traits(algo.advantage).needs_critic:
        batch = stack(batch, _segment_batch(batch, samples, segments, pad_id), pad_id)
        mask = batch.loss_mask
    if algo.distill_coef > 0:
        assert batch.teacher_logprobs is not None, "distillation needs the teacher's log-probs"
        # Against the behaviour log-probs: the policy that sampled each token, whichever
        # version that was (scheduler.max_staleness), as the engine recorded it.
        advantages = with_distillation(
            batch.advantages, batch.behaviour_logprobs, batch.teacher_logprobs, mask, algo
        )
        batch = dataclasses.replace(batch, advantages=advantages)
        metrics["distill/reverse_kl"] = reverse_kl(
            batch.behaviour_logprobs, batch.teacher_logprobs, mask
        ).item()

    correction = cfg.algorithm.off_policy
    if OFF_POLICY_CORRECTIONS.traits(correction).needs_proximal and not proximal_from_forward(cfg):
        is_weights, loss_mask = OFF_POLICY_CORRECTIONS.get(correction)(
            batch.old_logprobs, batch.behaviour_logprobs, mask, algo
        )
        batch = dataclasses.replace(batch, is_weights=is_weights, loss_mask=loss_mask)
        metrics["off_policy/weight_mean"] = masked_mean(is_weights, loss_mask).item()
    if recomputes_old_logprobs(cfg):
        rows = with_segments(samples)[: batch.num_sequences]  # the batch's rows, in order
        ages = None if step is None else torch.tensor([step - 1 - s.policy_version for s in rows])
        metrics.update(
            mismatch_metrics(
                batch.old_logprobs, batch.behaviour_logprobs, mask, batch.loss_mask, ages
            )
        )
    return batch, critic_batch, metrics


def _segment_batch(
    batch: Batch, samples: list[Sample], segments: list[Sample], pad_id: int
) -> Batch:
    """The rows of agent episodes' earlier segments (rl.agents.api_calls), each with its
    episode's advantage: the one at its last segment's first trained token in `batch` (an
    outcome advantage is the same at every token of a sequence)."""
    first = (batch.loss_mask > 0).float().argmax(dim=1)
    advantage = batch.advantages[torch.arange(len(samples)), first]
    owner = [
        row for row, s in enumerate(samples) if s.episode is not None for _ in s.episode.segments
    ]
    rows = build_batch(segments, pad_id)
    rows.advantages = advantage[owner, None] * rows.loss_mask
    return rows


class TrainerSide:
    """The policy trainer, critic and weight sync as the scheduler sees them: annotation and
    training run one at a time on a background thread (the trainer ranks do one thing at a
    time anyway); a weight push, or a lost rollout worker's replacement, is called when
    neither is running."""

    def __init__(
        self,
        cfg: Config,
        trainers: PolicyRanks,
        critic: CriticRanks | None,
        weight_sync: WeightSync,
        pad_id: int,
        teacher: TeacherRanks | None = None,
    ) -> None:
        self.cfg = cfg
        self.trainers, self.critic, self.weight_sync = trainers, critic, weight_sync
        self.teacher = teacher
        self.pad_id = pad_id
        self.kl_controller = KLController(cfg.algorithm)
        self.needs_annotation = (
            recomputes_old_logprobs(cfg)
            or cfg.algorithm.kl_coef > 0
            or critic is not None
            or teacher is not None
        )
        self.keeps_pushed_weights = cfg.scheduler.keeps_pushed_weights
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        try:  # the sizes MFU is counted from; other architectures report no MFU
            self._shape: ModelShape | None = ModelShape.read(Path(cfg.model.path))
        except ValueError:
            self._shape = None

    def annotate(self, samples: list[Sample]) -> Future:
        return self._thread.submit(
            annotate_samples,
            self.cfg,
            samples,
            self.pad_id,
            self.trainers,
            self.critic,
            self.teacher,
        )

    def train(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        return self._thread.submit(self._train, step, samples, scores, streamed=False)

    def stream(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        return self._thread.submit(self._stream, samples, scores)

    def finish(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        return self._thread.submit(self._train, step, samples, scores, streamed=True)

    def _stream(self, samples: list[Sample], scores: list[float]) -> list[Sample]:
        """One chunk of a streamed step's groups: annotated at the weights the step starts from
        (no optimizer step comes before its end), its batch built alone (each group's
        advantages are its own: the config checks refuse estimators that whiten over the step)
        and its gradients added to the step's, in an order-independent exact sum."""
        if self.needs_annotation:
            annotate_samples(
                self.cfg, samples, self.pad_id, self.trainers, self.critic, self.teacher
            )
        batch, _, _ = prepare_batch(self.cfg, samples, scores, self.pad_id, self.kl_controller.coef)
        self.trainers.accumulate_chunk(batch, samples[0].group_id)
        return samples

    def _train(
        self, step: int, samples: list[Sample], scores: list[float], streamed: bool
    ) -> dict[str, float]:
        """The step on annotated `samples`; `streamed`: their gradients are in (`stream`), so
        only the optimizer step is left. The whole step's batch still gives its metrics, the
        KL coefficient's adaptation and the critic's step, which is not streamed."""
        if not samples:  # dynamic sampling found no informative group: nothing to learn
            return {}
        batch, critic_batch, metrics = prepare_batch(
            self.cfg, samples, scores, self.pad_id, self.kl_controller.coef, step
        )
        self.kl_controller.adapt(metrics, batch.num_sequences)
        if streamed:
            metrics.update(self.trainers.step_accumulated())
        else:
            metrics.update(self.trainers.train_step(batch))
        metrics.update(self._utilisation(batch, metrics["timing/train_tokens_per_s"]))
        if self.critic is not None:
            metrics.update(self.critic.train_step(critic_batch))
        return metrics

    def _utilisation(self, batch: Batch, tokens_per_s: float) -> dict[str, float]:
        """The train step's model TFLOP/s (rl.observe.flops), and its MFU on GPUs of known peak."""
        if self._shape is None:
            return {}
        lengths = batch.attention_mask.sum(dim=1).tolist()
        achieved = train_flops(self._shape, lengths) / sum(lengths) * tokens_per_s
        metrics = {"perf/train_tflops": achieved / 1e12}
        if (peak := peak_flops(self.trainers.device_name)) is not None:
            metrics["perf/mfu"] = achieved / (peak * self.cfg.trainer.num_workers)
        return metrics

    def push(self, version: int) -> dict[str, float]:
        return self.weight_sync.push(version)

    def release_memory(self) -> None:
        self.trainers.release_memory()
        if self.critic is not None:
            self.critic.release_memory()
        if self.teacher is not None:
            self.teacher.release_memory()

    def replace_rollout_worker(self, worker: int, version: int) -> None:
        """A fresh rollout worker for a lost one, serving `version`. Like `push`, on the
        driver's thread while this side's thread is idle, so the ranks stream that version
        (their weights, or their copies of the last push: WeightSync.replace)."""
        self.weight_sync.replace([worker], version)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
