"""From prompts to a training `Batch`: generate, score, then old/reference log-probs, values,
off-policy weights, KL penalty and advantages.

The driver calls `collect_rollouts` and then `annotate_batch`; both are plain functions over
the role groups, so each step's data flow can be read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from rl.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    adaptive_kl_coef,
    at_last_token,
    dynamic_sampling_keep,
    masked_mean,
    overlong_penalty,
)
from rl.config import AlgorithmConfig, Config
from rl.critic_group import CriticGroup
from rl.data import PromptStream
from rl.prompts import encode_prompt
from rl.rewards import RewardScorer
from rl.rollout_group import RolloutGroup
from rl.train_group import TrainGroup
from rl.types import Batch, Sample, SamplingParams


@dataclass
class Rollouts:
    """Scored samples, group by group (G consecutive samples per prompt)."""

    samples: list[Sample] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def collect_rollouts(
    cfg: Config,
    rollout: RolloutGroup,
    scorer: RewardScorer,
    stream: PromptStream,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    version: int,
) -> Rollouts:
    """`run.prompts_per_step` prompts x G responses, scored (with overlong shaping).

    With dynamic sampling (DAPO), groups whose scores are all equal carry no signal: they are
    dropped and more prompts are generated, at most `algorithm.max_sampling_rounds` rounds; the
    step then trains on however many informative groups it found (possibly fewer).
    """
    algo, group_size, wanted = cfg.algorithm, cfg.algorithm.group_size, cfg.run.prompts_per_step
    kept = Rollouts()
    num_rounds = num_generated = 0
    all_scores: list[torch.Tensor] = []
    while len(kept.samples) < wanted * group_size and num_rounds < algo.max_sampling_rounds:
        num_rounds += 1
        examples = stream.next_batch(wanted)
        prompts = [encode_prompt(tokenizer, ex["prompt"]) for ex in examples]
        samples = rollout.generate(prompts, sampling, policy_version=version)
        num_generated += len(samples)
        per_sample = [examples[s.group_id] for s in samples]
        scores, reward_metrics = scorer.score(
            [ex["prompt"] for ex in per_sample], [s.response_text for s in samples], per_sample
        )
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        scores = scores + overlong_penalty(
            lengths, sampling.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        )
        all_scores.append(scores)
        _accumulate(kept.metrics, reward_metrics)
        keep = (
            dynamic_sampling_keep(scores, group_size)
            if algo.dynamic_sampling
            else torch.ones(len(examples), dtype=torch.bool)
        )
        for group in keep.nonzero().flatten().tolist():
            rows = range(group * group_size, (group + 1) * group_size)
            kept.samples.extend(samples[row] for row in rows)
            kept.scores.extend(scores[row].item() for row in rows)
        if not algo.dynamic_sampling:
            break
    del kept.samples[wanted * group_size :], kept.scores[wanted * group_size :]
    generated = torch.cat(all_scores)
    kept.metrics.update(
        {
            "reward/mean": generated.mean().item(),
            "reward/solved_groups": (generated.view(-1, group_size).max(dim=1).values > 0)
            .float()
            .mean()
            .item(),
            "rollout/sampling_rounds": float(num_rounds),
            "rollout/kept_groups": len(kept.samples) / group_size,
            "response/mean_tokens": sum(len(s.response_ids) for s in kept.samples)
            / max(len(kept.samples), 1),
            "response/truncated": sum(s.finish_reason == "length" for s in kept.samples)
            / max(len(kept.samples), 1),
            "rollout/generated_samples": float(num_generated),
        }
    )
    return kept


def _accumulate(total: dict[str, float], new: dict[str, float]) -> None:
    """Counts (errors, timeouts) add up over sampling rounds; means keep the latest round."""
    for key, value in new.items():
        is_count = key.endswith(("errors", "timeouts"))
        total[key] = total.get(key, 0.0) + value if is_count else value


class KLController:
    """The KL-penalty coefficient: fixed, or adapted towards `algorithm.kl_target`."""

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.kl_coef

    def update(self, observed_kl: float, num_samples: int) -> None:
        if self.cfg.kl_target > 0:
            self.coef = adaptive_kl_coef(
                self.coef, observed_kl, self.cfg.kl_target, num_samples, self.cfg.kl_horizon
            )


def annotate_batch(
    cfg: Config,
    batch: Batch,
    scores: torch.Tensor,
    trainers: TrainGroup,
    critic: CriticGroup | None,
    kl_controller: KLController,
) -> dict[str, float]:
    """Fill `batch` in place for training; returns metrics.

    scores: [B] sequence rewards. Order matters: the proximal log-probs come first because the
    off-policy weights and the KL penalty are measured from them.
    """
    algo = cfg.algorithm
    metrics: dict[str, float] = {}
    # The full response mask: rewards, baselines and values cover every generated token even
    # when the off-policy correction later drops some of them from the loss.
    mask = batch.loss_mask
    if algo.recompute_old_logprobs:
        batch.old_logprobs = trainers.compute_logprobs(batch)
        gap = (batch.old_logprobs - batch.behaviour_logprobs).abs() * mask
        metrics["off_policy/max_abs_logprob_gap"] = gap.max().item()
    if algo.kl_coef > 0:
        batch.ref_logprobs = trainers.compute_logprobs(batch, model="reference")
    values = None
    if critic is not None:
        values = batch.old_values = critic.compute_values(batch)

    rewards = at_last_token(scores, mask)
    if algo.kl_coef > 0 and algo.kl_in_reward:
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(batch.old_logprobs, batch.ref_logprobs) * mask
        rewards = rewards - kl_controller.coef * kl
        sequence_kl = kl.sum(dim=1).mean().item()
        metrics.update({"kl/reward_penalty": sequence_kl, "kl/coef": kl_controller.coef})
        kl_controller.update(sequence_kl, batch.num_sequences)
    batch.advantages, batch.returns = ADVANTAGES.get(algo.advantage)(rewards, mask, algo, values)
    metrics["advantage/abs_mean"] = masked_mean(batch.advantages.abs(), mask).item()

    if algo.off_policy != "none":
        batch.is_weights, batch.loss_mask = OFF_POLICY_CORRECTIONS.get(algo.off_policy)(
            batch.old_logprobs, batch.behaviour_logprobs, mask, algo
        )
        metrics["off_policy/kept_token_frac"] = (batch.loss_mask.sum() / mask.sum()).item()
        metrics["off_policy/weight_mean"] = masked_mean(batch.is_weights, batch.loss_mask).item()
    return metrics
