"""A prompt group as the scheduler tracks it, and the metrics a step reports of its groups."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl.agents.episode import episode_metrics
from rl.types import NOT_SAMPLED, Sample


@dataclass
class Group:
    """One prompt's G samples, tied to the step that will train on them."""

    group_id: int
    step: int
    example: dict
    samples: list[Sample]
    scores: list[float] = field(default_factory=list)
    kept: bool | None = None  # None until scored; then whether its step trains on it
    reward_metrics: dict[str, float] = field(default_factory=dict)  # of its scoring call
    annotated: bool = False
    # Settings.streaming: its gradients are in the trainer's (not recorded: a resumed run
    # streams again from zero gradients, in the same order).
    streamed: bool = False
    # partial_rollout "carry" (rl.run.scheduler.carry_over): the epoch it started in, its place
    # on the token clock once finished (epoch, tokens generated in it), and its samples'
    # lengths when the current epoch opened (not recorded: a checkpoint is at a boundary).
    start_epoch: int = 0
    finished_at: tuple[int, int] | None = None
    segment_start: list[int] = field(default_factory=list)


@dataclass
class InFlight:
    """The scheduler at a sync, as a checkpoint records it (Scheduler.state_dict): the next
    group id, admission's counts per step ahead, every group no step has trained yet,
    scored (`kept` set) or still to generate (fresh, or partial with its prefix), the
    abort point in force until the next sync, and under partial_rollout "carry" its
    bookkeeping (CarryOver.state_dict)."""

    next_group_id: int
    admission: dict[str, list[int]]
    groups: list[Group]
    abort_every: int
    carry: dict | None = None


def step_metrics(
    step: int,
    finished: list[Group],
    kept: list[Group],
    reward_calls: list[tuple[dict[str, float], int]],
) -> dict[str, float]:
    """What step `step` generated (every scored group) and trains on (the kept ones);
    `reward_calls` are the metrics and sample counts of the scoring calls of its groups."""
    samples = [sample for group in kept for sample in group.samples]
    num_samples = max(len(samples), 1)
    lags = [step - 1 - s.policy_version for s in samples]
    metrics = {
        "rollout/generated_groups": float(len(finished)),
        "rollout/kept_groups": float(len(kept)),
        "rollout/tokens": float(sum(len(s.response_ids) for s in samples)),
        "response/mean_tokens": sum(len(s.response_ids) for s in samples) / num_samples,
        "response/max_tokens": float(max((len(s.response_ids) for s in samples), default=0)),
        "response/truncated": sum(s.finish_reason == "length" for s in samples) / num_samples,
        "rollout/staleness_mean": sum(lags) / num_samples,
        "rollout/staleness_max": float(max(lags, default=0)),
        "rollout/resumed_samples": sum(
            len(set(s.token_versions) - {NOT_SAMPLED}) > 1 for s in samples
        )
        / num_samples,
        **episode_metrics(samples),
    }
    if finished:
        scores = torch.tensor([score for group in finished for score in group.scores])
        metrics["reward/mean"] = scores.mean().item()
        metrics["reward/solved_groups"] = sum(max(g.scores) > 0 for g in finished) / len(finished)
    total = sum(n for _, n in reward_calls)
    for key in reward_calls[0][0] if reward_calls else {}:
        # Counts (errors, timeouts) add up over calls; means and accuracies (fractions of
        # samples) are weighted by their samples.
        if key.endswith(("errors", "timeouts")):
            metrics[key] = sum(m[key] for m, _ in reward_calls)
        else:
            metrics[key] = sum(m[key] * n for m, n in reward_calls) / total
    return metrics
