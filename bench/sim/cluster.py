"""One simulated run: the real scheduler (rl.run.scheduler.loop) driving simulated engines, a
simulated trainer and scorer, on a simulated clock.

Placements, as `rl.cluster` lays out a run:
- "colocate": engines and trainer on the same GPUs. At k = 0 they take turns (the engines
  sleep while the trainer computes, the trainer's state goes to the host while they
  generate: `Settings.release_memory`), and each turn change moves that memory over PCIe.
  At k >= 1 both keep their memory (the KV cache shrinks by the trainer's shard) and compute
  at once: processes on one GPU without MPS are time-sliced, so while both are busy each runs
  at `SHARED_SPEED` of the GPU, the trainer as slowly as its slowest rank.
- "split": engines on `rollout_gpus`, the trainer on the rest; neither slows the other.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from rl.config import PartialRollout, SchedulerConfig
from rl.config.tree import groups_in_flight
from rl.observe.trace import Trace, covered_seconds
from rl.run.scheduler.loop import Scheduler
from rl.run.scheduler.ports import Settings
from rl.types import Sample, SamplingParams, fresh_samples
from sim.clock import SimClock
from sim.costs import CostModel
from sim.engine import SimEngine, SimRollout
from sim.lengths import uniform

SHARED_SPEED = 0.5  # each of two busy processes' share of a time-sliced GPU


@dataclass(frozen=True)
class Placement:
    kind: Literal["colocate", "split"]
    gpus: int
    rollout_gpus: int  # split: the engines' GPUs; colocate: all of them

    @classmethod
    def colocate(cls, gpus: int) -> Placement:
        return cls("colocate", gpus, gpus)

    @classmethod
    def split(cls, gpus: int, rollout_gpus: int) -> Placement:
        if not 0 < rollout_gpus < gpus:
            raise ValueError(f"split placement: {rollout_gpus} rollout GPUs of {gpus}")
        return cls("split", gpus, rollout_gpus)

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.kind == "colocate" else self.gpus - self.rollout_gpus

    def label(self) -> str:
        if self.kind == "colocate":
            return "colocate"
        return f"split {self.rollout_gpus}:{self.trainer_gpus}"


@dataclass(frozen=True)
class Workload:
    num_steps: int
    groups_per_step: int
    group_size: int
    prompt_tokens: int
    length: Callable[[Sample], int]  # a sample's response length (sim.lengths)
    max_tokens: int
    accuracy: float = 0.5  # the chance a sample is right (what dynamic sampling filters on)
    needs_annotation: bool = False  # old/reference log-probs computed before each step
    tokens_per_id: int = 32  # real tokens a simulated token id stands for (sim.engine)


@dataclass(frozen=True)
class Schedule:
    max_staleness: int
    partial_rollout: PartialRollout = "finish"
    # partial_rollout "abort": tokens, or "auto" (the scheduler's default, the 95th
    # percentile of the last synced step's lengths)
    abort_every: int | Literal["auto"] = "auto"
    dynamic_sampling_rounds: int = 0  # 0: off
    # partial_rollout "carry": the bounds and the groups kept live (0: 2 x groups_per_step),
    # by default the config's
    max_token_age: int = SchedulerConfig.model_fields["max_token_age"].default
    max_stale_share: float = SchedulerConfig.model_fields["max_stale_share"].default
    groups_in_flight: int = 0
    streaming: bool = False  # scheduler.streaming: the trainer takes a step chunk by chunk
    # Groups a streamed chunk holds; 0: enough for a sample on every trainer GPU (the
    # config's default fills one micro-batch on every rank).
    stream_groups: int = 0

    def label(self) -> str:
        mode = self.partial_rollout
        if mode == "abort" and self.abort_every != "auto":
            mode += f" every {self.abort_every}"
        return f"k={self.max_staleness} {mode}" + (" streaming" if self.streaming else "")


@dataclass
class Result:
    steps: list[dict[str, float]]
    steps_per_hour: float  # in the steady state (simulate)
    rollout_idle: float  # of the engines' GPU time, in that window
    trainer_idle: float
    gpu_idle: float  # of all GPUs' time: neither generating, training nor syncing
    staleness_tokens: dict[int, int]  # tokens trained on, by how many versions old
    generated_tokens: int
    reprefilled_tokens: int  # prefixes prefilled again: after an abort, or a preemption
    dropped_tokens: int  # generated for groups dynamic sampling dropped
    preemptions: int

    def mean_after_first(self, key: str) -> float:
        """A step metric's mean over the steps after the first (the only one, alone)."""
        values = [m[key] for m in self.steps[1:]] or [m[key] for m in self.steps]
        return sum(values) / len(values)


@dataclass
class SimTrainer:
    """The TrainerPort: each call holds the trainer for its cost, at its share of the GPUs."""

    clock: SimClock
    cost: CostModel
    placement: Placement
    rollout: SimRollout
    tokens_per_id: int
    needs_annotation: bool
    keeps_pushed_weights: bool
    speed: float = 1.0
    busy: list[tuple[float, float]] = field(default_factory=list)
    syncs: list[tuple[float, float]] = field(default_factory=list)
    staleness_tokens: Counter = field(default_factory=Counter)
    on_busy: Callable[[bool], None] = lambda busy: None

    def __post_init__(self) -> None:
        self._call: tuple[Future, object] | None = None  # the running call and its result
        self._remaining = 0.0  # its seconds left at full speed
        self._since = 0.0
        self._epoch = 0
        self._offloaded = False

    def _lengths(self, samples: list[Sample]) -> list[int]:
        tpi = self.tokens_per_id
        return [(len(s.prompt_ids) + len(s.response_ids)) * tpi for s in samples]

    def _start(self, seconds: float, result: object) -> Future:
        assert self._call is None, "the trainer runs one call at a time"
        if self._offloaded:  # time-sliced: its state comes back first
            seconds += self.cost.trainer_offload_s(self.placement.trainer_gpus)
            self._offloaded = False
        future: Future = Future()
        self._call, self._remaining, self._since = (future, result), seconds, self.clock.now()
        self._busy_since = self.clock.now()
        self.on_busy(True)
        self._schedule()
        return future

    def _schedule(self) -> None:
        self._epoch += 1
        epoch = self._epoch
        self.clock.at(self._since + self._remaining / self.speed, lambda: self._end(epoch))

    def set_speed(self, speed: float) -> None:
        if self._call is not None and speed != self.speed:
            now = self.clock.now()
            self._remaining -= (now - self._since) * self.speed
            self._since = now
            self.speed = speed
            self._schedule()
        self.speed = speed

    def _end(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        (future, result), self._call = self._call, None
        self.busy.append((self._busy_since, self.clock.now()))
        self.on_busy(False)
        self.clock.resolve(future, result)

    def annotate(self, samples: list[Sample]) -> Future:
        gpus = self.placement.trainer_gpus
        return self._start(self.cost.annotate_s(self._lengths(samples), gpus), samples)

    def train(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        self._count_staleness(step, samples)
        gpus = self.placement.trainer_gpus
        return self._start(self.cost.train_s(self._lengths(samples), gpus), {})

    def stream(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """One chunk's annotation and forward/backward: training's cost is per token (a
        chunk is taken to fill every trainer GPU)."""
        gpus, lengths = self.placement.trainer_gpus, self._lengths(samples)
        seconds = self.cost.train_s(lengths, gpus)
        if self.needs_annotation:
            seconds += self.cost.annotate_s(lengths, gpus)
        return self._start(seconds, samples)

    def finish(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """The optimizer step, whose cost the model leaves out of training's (as `train`)."""
        self._count_staleness(step, samples)
        return self._start(0.0, {})

    def _count_staleness(self, step: int, samples: list[Sample]) -> None:
        for sample in samples:
            for version, ids in Counter(sample.token_versions).items():
                self.staleness_tokens[step - 1 - version] += ids * self.tokens_per_id

    def release_memory(self) -> None:
        if not self._offloaded:
            self.clock.advance(self.cost.trainer_offload_s(self.placement.trainer_gpus))
            self._offloaded = True

    def push(self, version: int) -> dict[str, float]:
        start = self.clock.now()
        placement, node = self.placement, self.cost.gpu.gpus_per_node
        one_node = placement.kind == "colocate" and placement.gpus <= node
        self.clock.advance(self.cost.sync_s(colocated_on_one_node=one_node))
        self.syncs.append((start, self.clock.now()))
        for engine in self.rollout.engines:
            engine.version = version
        return {}

    def replace_rollout_worker(self, worker: int, version: int) -> None:
        raise NotImplementedError("lost workers are not simulated")


@dataclass
class SimScorer:
    """Rewards cost nothing here. A sample is right with probability `accuracy`, fixed by its
    ids: groups all right or all wrong are what dynamic sampling drops."""

    clock: SimClock
    accuracy: float
    tokens_per_id: int
    dropped_tokens: int = 0

    def score(self, groups: list[tuple[list[Sample], dict]]) -> Future:
        def right(sample: Sample) -> float:
            return float(uniform(sample.group_id, sample.index, 2) < self.accuracy)

        scores = [[right(s) for s in samples] for samples, _ in groups]
        for (samples, _), group in zip(groups, scores, strict=True):
            if len(set(group)) == 1:  # dropped if dynamic sampling is on (counted by caller)
                ids = sum(len(s.response_ids) for s in samples)
                self.dropped_tokens += ids * self.tokens_per_id
        return self.clock.done((scores, {}))


def kv_capacity_ids(cost: CostModel, workload: Workload, trainer_sharing: int = 0) -> int:
    """An engine's KV cache in simulated ids, beside a trainer sharded over `trainer_sharing`
    GPUs it shares (0: none); ValueError if one sample would not fit."""
    tpi = workload.tokens_per_id
    capacity = cost.kv_capacity_tokens(trainer_sharing) // tpi
    if capacity * tpi < workload.prompt_tokens + workload.max_tokens:
        raise ValueError(
            f"an engine's KV cache holds {capacity * tpi} tokens, less than one sample "
            f"({workload.prompt_tokens} + {workload.max_tokens})"
        )
    return capacity


def simulate(
    cost: CostModel, placement: Placement, workload: Workload, schedule: Schedule
) -> Result:
    """Run the real scheduler over `workload` on `placement`'s simulated GPUs."""
    clock = SimClock()
    tpi = workload.tokens_per_id
    time_sliced = placement.kind == "colocate" and schedule.max_staleness == 0
    shares_gpus = placement.kind == "colocate" and not time_sliced
    capacity = kv_capacity_ids(cost, workload, placement.trainer_gpus if shares_gpus else 0)
    num_engines = placement.rollout_gpus // cost.model.tp
    assert num_engines >= 1, (placement, cost.model.tp)
    busy_engines = 0

    def engine_busy(busy: bool) -> None:
        nonlocal busy_engines
        busy_engines += 1 if busy else -1
        if shares_gpus:
            trainer.set_speed(SHARED_SPEED if busy_engines else 1.0)

    def trainer_busy(busy: bool) -> None:
        if shares_gpus:
            for engine in engines:
                engine.set_speed(SHARED_SPEED if busy else 1.0)
            trainer.set_speed(SHARED_SPEED if busy and busy_engines else 1.0)

    engines = [
        SimEngine(i, clock, cost, workload.length, capacity, tpi, on_busy=engine_busy)
        for i in range(num_engines)
    ]
    rollout = SimRollout(engines, cost.engine_sleep_s() if time_sliced else 0.0)
    trainer = SimTrainer(
        clock, cost, placement, rollout, tpi, workload.needs_annotation,
        keeps_pushed_weights=schedule.max_staleness >= 1, on_busy=trainer_busy,
    )  # fmt: skip
    scorer = SimScorer(clock, workload.accuracy, tpi)
    rounds = schedule.dynamic_sampling_rounds
    settings = Settings(
        num_steps=workload.num_steps,
        groups_per_step=workload.groups_per_step,
        group_size=workload.group_size,
        max_staleness=schedule.max_staleness,
        partial_rollout=schedule.partial_rollout,
        # The scheduler sees ids: lengths, max_new_tokens and stop points alike.
        abort_every=(
            schedule.abort_every
            if schedule.abort_every == "auto"
            else max(1, schedule.abort_every // tpi)
        ),
        dynamic_sampling=rounds > 0,
        max_groups_per_step=max(1, rounds) * workload.groups_per_step,
        release_memory=time_sliced,
        max_rollout_restarts=0,
        max_token_age=schedule.max_token_age,
        max_stale_share=schedule.max_stale_share,
        groups_in_flight=groups_in_flight(schedule.groups_in_flight, workload.groups_per_step),
        streaming=schedule.streaming,
        stream_groups=schedule.stream_groups
        or math.ceil(placement.trainer_gpus / workload.group_size),
    )
    # The trace's lanes stand for one device each: the simulation measures its GPUs itself.
    lanes = {f"rollout-{i}": [i] for i in range(num_engines)}
    trace = Trace({**lanes, "trainer": [num_engines], "reward": []}, clock=clock.now)
    prompt = [1] * (workload.prompt_tokens // tpi)

    def next_group(group_id: int) -> tuple[dict, list[Sample]]:
        return {}, fresh_samples([prompt], workload.group_size, [group_id])

    scheduler = Scheduler(
        settings,
        SamplingParams(n=workload.group_size, max_new_tokens=workload.max_tokens // tpi),
        rollout, trainer, scorer, next_group, trace, clock=clock,
    )  # fmt: skip
    steps, ends = [], []
    for _, metrics in scheduler.run():
        for key in ("rollout/tokens", "response/mean_tokens", "response/max_tokens"):
            metrics[key] *= tpi  # the scheduler counted ids
        if "perf/gen_tokens_per_s" in metrics:
            metrics["perf/gen_tokens_per_s"] *= tpi
        steps.append(metrics)
        ends.append(clock.now())
    return measure(
        steps, ends, cost, placement, engines, trainer, scorer.dropped_tokens if rounds else 0
    )


def measure(
    steps: list[dict[str, float]],
    ends: list[float],
    cost: CostModel,
    placement: Placement,
    engines: list[SimEngine],
    trainer: SimTrainer,
    dropped_tokens: int,
) -> Result:
    """A run's Result in the steady state: neither the first step (the pipeline filling) nor
    the last (at k >= 1 its groups were mostly generated during the steps before). `ends`:
    when each step's sync ended; the run ends at the clock's time now."""
    end, tpi = trainer.clock.now(), trainer.tokens_per_id
    window, counted = (
        ((ends[0], ends[-2]), len(ends) - 2) if len(ends) >= 3 else ((0.0, end), len(ends))
    )
    span = window[1] - window[0]
    syncs = trainer.syncs
    rollout_busy = [
        covered_seconds([*engine.busy_until(end), *syncs], *window) for engine in engines
    ]
    trainer_busy_s = covered_seconds([*trainer.busy, *syncs], *window)
    if placement.kind == "colocate":
        gpu_busy = sum(
            covered_seconds([*engine.busy_until(end), *trainer.busy, *syncs], *window)
            for engine in engines
        ) / len(engines)
    else:
        rollout_share = len(engines) * cost.model.tp / placement.gpus
        gpu_busy = (
            rollout_share * sum(rollout_busy) / len(engines) + (1 - rollout_share) * trainer_busy_s
        )
    return Result(
        steps=steps,
        steps_per_hour=3600 * counted / span,
        rollout_idle=max(0.0, 1 - sum(rollout_busy) / (len(engines) * span)),
        trainer_idle=max(0.0, 1 - trainer_busy_s / span),
        gpu_idle=max(0.0, 1 - gpu_busy / span),
        staleness_tokens=dict(sorted(trainer.staleness_tokens.items())),
        generated_tokens=sum(e.stats.generated_ids for e in engines) * tpi,
        reprefilled_tokens=sum(e.stats.reprefilled_ids for e in engines) * tpi,
        dropped_tokens=dropped_tokens,
        preemptions=sum(e.stats.preemptions for e in engines),
    )
