"""What the scheduler (rl.run.scheduler.loop) is handed: its `Settings`, and three small ports to the
workers, with `WorkerLost`.

The driver implements the ports with Ray actors (rl.cluster.rollout_replicas, rl.run.experience); the unit
tests with fakes on threads. No Ray type crosses them, so the fakes can produce every outcome
the real workers can, a dead rollout worker included.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol

from rl.config import Config, PartialRollout
from rl.config.tree import groups_in_flight, stream_groups
from rl.types import Sample, SamplingParams


@dataclass
class Settings:
    """The loop's parameters, derived from the run, algorithm, scheduler and faults sections
    (`from_config`; the config holds every default)."""

    num_steps: int
    groups_per_step: int
    group_size: int
    max_staleness: int
    partial_rollout: PartialRollout
    # partial_rollout "abort": tokens a later step's sample makes per version, or "auto"
    # (rl.run.scheduler.loop.abort_point of the step last synced).
    abort_every: int | Literal["auto"]
    dynamic_sampling: bool
    max_groups_per_step: int  # groups started for one step, its redraws included
    # Colocated on-policy on GPUs: the rollout engines free their memory while training.
    release_memory: bool
    # Rollout workers lost in a run (generating or receiving weights) before it fails.
    max_rollout_restarts: int
    # partial_rollout "carry" (rl.run.scheduler.carry_over): the bounds, and the groups kept live.
    max_token_age: int
    max_stale_share: float
    groups_in_flight: int
    # Train a step chunk by chunk as its groups finish (TrainerPort.stream), then `finish`;
    # a chunk is this many groups (consecutive among the step's started ones, by id).
    streaming: bool
    stream_groups: int

    @classmethod
    def from_config(cls, config: Config, use_gpu: bool) -> Settings:
        algo, sched = config.algorithm, config.scheduler
        rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
        return cls(
            num_steps=config.run.num_steps,
            groups_per_step=config.run.prompts_per_step,
            group_size=algo.group_size,
            max_staleness=sched.max_staleness,
            partial_rollout=sched.partial_rollout,
            abort_every=sched.abort_every,
            dynamic_sampling=algo.dynamic_sampling,
            max_groups_per_step=rounds * config.run.prompts_per_step,
            release_memory=sched.time_sliced and use_gpu,
            max_rollout_restarts=config.faults.max_rollout_restarts,
            max_token_age=sched.max_token_age,
            max_stale_share=sched.max_stale_share,
            groups_in_flight=groups_in_flight(sched.groups_in_flight, config.run.prompts_per_step),
            streaming=sched.streaming,
            stream_groups=stream_groups(sched.stream_groups, config.trainer, algo.group_size),
        )


class WorkerLost(Exception):
    """A rollout worker's process died: what it was generating is gone. A poll future
    raises it; the scheduler then has the worker replaced and regenerates its groups."""

    def __init__(self, worker: int, reason: str = "") -> None:
        super().__init__(f"rollout worker {worker} was lost" + (f": {reason}" if reason else ""))
        self.worker = worker


class RolloutPort(Protocol):
    num_workers: int

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        """Start batches of samples under their keys; returns each key's worker."""

    def poll(self, worker: int) -> Future:
        """Future of {key: samples} of every batch `worker` finished (or aborted) since its
        last poll, once there is at least one; it raises WorkerLost if the worker died."""

    def interrupt(self) -> int:
        """Abort what every live worker generates (a dead one is skipped: its poll tells)."""

    def release_memory(self) -> None:
        """Free the engines' weights and KV cache on the devices (time-sliced GPUs)."""

    def reclaim_weights(self) -> None:
        """Take the weights' memory back, not the KV cache's, for a weight push."""

    def reclaim_memory(self) -> None:
        """Take all of it back, to generate."""


class TrainerPort(Protocol):
    needs_annotation: bool  # proximal/reference log-probs or values are computed before training
    # The trainer can stream the version it last pushed after training on (a copy kept):
    # SchedulerConfig.keeps_pushed_weights.
    keeps_pushed_weights: bool

    def annotate(self, samples: list[Sample]) -> Future: ...

    def train(self, step: int, samples: list[Sample], scores: list[float]) -> Future: ...

    def stream(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """Settings.streaming: annotate one chunk of `step`'s groups (the future gives its
        samples back, annotated) and add its gradients to those of the step's chunks streamed
        before it, exactly, so that their order does not matter."""

    def finish(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """Settings.streaming: the optimizer step of `step`, whose groups (`samples`, every
        one streamed) are in; the future gives train's metrics."""

    def release_memory(self) -> None:
        """Move the training state off the devices (time-sliced GPUs); the next call that
        computes brings it back."""

    def push(self, version: int) -> dict[str, float]:
        """Every rollout worker serves `version` on return; workers lost during the transfer
        are replaced, counted in "weight_sync/workers_replaced"."""

    def replace_rollout_worker(self, worker: int, version: int) -> None:
        """Replace rollout worker `worker` by a fresh one serving `version` (0: the base
        checkpoint, which a fresh worker loads anyway). Called only while no annotate or
        train call runs, with `version` 0, the trainer's own, or (keeps_pushed_weights) the
        last pushed."""


class ScorerPort(Protocol):
    def score(self, groups: list[tuple[list[Sample], dict]]) -> Future:
        """Future of (scores per group, metrics of the call) for (samples, example) pairs."""
