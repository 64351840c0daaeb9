"""Simulated vLLM engines behind the scheduler's RolloutPort.

An engine batches continuously, as vLLM does: every running sample gains a token per decode
step, a step costs `CostModel.decode_step_s` of the batch and of the contexts its KV cache
holds, and a sample joins the batch (after a prefill of its whole context) as soon as the
KV cache and `max_num_seqs` have room for it. When the running contexts outgrow the KV
cache, the sample that joined last is preempted: its cache is dropped and it waits at the
head of the queue to be prefilled again, prefix and all (vLLM's recompute preemption).

To keep hundreds of engines and their long-tailed batches cheap, an engine never touches its
running samples between events: all of them gain the same tokens, so it counts decode steps
(`progress`), and a sample finishes when `progress` reaches the step it ends at. The step
time is recomputed at every event, and at least every `SEGMENT_STEPS` steps as contexts grow.

A simulated token id stands for `tokens_per_id` real tokens, so that a step's hundreds of
millions of tokens stay a few million list entries: lengths, costs and the staleness of a
sample are exact to that granularity.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from rl.types import Sample, SamplingParams
from sim.clock import SimClock
from sim.costs import CostModel

SEGMENT_STEPS = 256  # simulated steps at one step time, at most, while contexts grow


@dataclass
class _Queued:
    key: int
    sample: Sample
    stop_every: int  # in ids; 0: none
    length: int  # the response's whole length, in ids


@dataclass
class _Running:
    queued: _Queued
    end: int  # the response length (ids) it stops at: its own end, or an abort point
    joined: float  # the engine's progress when it joined
    done: int  # response ids it had when it joined


@dataclass
class EngineStats:
    generated_ids: int = 0
    prefilled_ids: int = 0
    reprefilled_ids: int = 0  # prefixes prefilled again: resumed after an abort or preempted
    preemptions: int = 0


@dataclass
class SimEngine:
    """One rollout engine (one vLLM instance of `cost.model.tp` GPUs)."""

    index: int
    clock: SimClock
    cost: CostModel
    length: Callable[[Sample], int]  # a sample's response length, in real tokens
    kv_capacity_ids: int
    tokens_per_id: int = 1
    on_busy: Callable[[bool], None] = lambda busy: None  # when it starts or stops running
    version: int = 0
    speed: float = 1.0  # the share of its GPUs it gets (colocated with a training step)
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.progress = 0.0  # decode steps run
        self.running: dict[int, _Running] = {}  # in the order they joined
        self.queue: deque[_Queued] = deque()
        self._ends: list[tuple[float, int]] = []  # (progress it ends at, run id), a heap
        self._context_offset = 0.0  # contexts of the running samples = offset + B x progress
        self._run_ids = itertools.count()
        self._since = 0.0  # when `progress` was last brought up to date (or a prefill ends)
        self.busy: list[tuple[float, float]] = []  # intervals with samples running
        self._busy_since: float | None = None
        self._step_s = 0.0  # the current segment's step time
        self._segment_end = 0.0  # the progress the scheduled event is for
        self._epoch = 0  # invalidates the event scheduled for an older segment
        self.batches: dict[int, list[Sample]] = {}  # key -> samples
        self.unfinished: dict[int, int] = {}  # key -> samples not finished yet
        self.finished: dict[int, list[Sample]] = {}
        self.waiting: Future | None = None  # the outstanding poll

    # -- the port's calls ----------------------------------------------------------------

    def submit(self, key: int, samples: list[Sample], stop_every: int) -> None:
        self._advance()
        self.batches[key], self.unfinished[key] = samples, len(samples)
        self.queue.extend(
            _Queued(key, sample, stop_every, max(1, -(-self.length(sample) // self.tokens_per_id)))
            for sample in samples
        )
        self._admit()
        self._schedule()

    def poll(self) -> Future:
        assert self.waiting is None
        future = self.waiting = Future()
        self._deliver()
        return future

    def interrupt(self) -> int:
        """Abort every sample in flight where it is (partial_rollout "interrupt"); their
        batches come back at once. Returns how many."""
        self._advance()
        aborted = len(self.running) + len(self.queue)
        for run in self.running.values():
            self._take_tokens(run)
            run.queued.sample.finish_reason = "abort"
        for queued in self.queue:
            queued.sample.finish_reason = "abort"
        self.running.clear()
        self.queue.clear()
        self._ends.clear()
        self.finished.update(self.batches)
        self.batches.clear()
        self.unfinished.clear()
        self._went_idle()
        self._deliver()
        self._schedule()
        return aborted

    def set_speed(self, speed: float) -> None:
        if speed != self.speed:
            self._advance()
            self.speed = speed
            self._schedule()

    def busy_until(self, now: float) -> list[tuple[float, float]]:
        """Its busy intervals (prefills included), the open one closed at `now`."""
        open_ = [(self._busy_since, now)] if self._busy_since is not None else []
        return self.busy + open_

    @property
    def load(self) -> int:
        """Samples in flight: where the rollout places the next batch."""
        return len(self.running) + len(self.queue)

    # -- batching -----------------------------------------------------------------------

    def _context(self) -> float:
        return self._context_offset + len(self.running) * self.progress

    def _advance(self) -> None:
        """Bring `progress` up to now (the decode steps since `_since`)."""
        now = self.clock.now()
        if self.running and now > self._since:
            self.progress = min(
                self._segment_end, self.progress + (now - self._since) / self._step_s
            )
            self._since = now
        self._since = max(self._since, now)

    def _admit(self) -> None:
        """Queued samples join while the batch and the KV cache have room, after a prefill
        of their whole context (prompt and any prefix: the cache of an older version, or of
        a preempted sample, is gone)."""
        was_busy = bool(self.running)
        prefill_s = 0.0
        while self.queue and len(self.running) < self.cost.eff.max_num_seqs:
            queued = self.queue[0]
            sample = queued.sample
            context = len(sample.prompt_ids) + len(sample.response_ids)
            if self.running and not self._has_room(context, len(self.running) + 1):
                break
            self.queue.popleft()
            done = len(sample.response_ids)
            end = queued.length
            if queued.stop_every:
                end = min(end, (done // queued.stop_every + 1) * queued.stop_every)
            run_id = next(self._run_ids)
            self.running[run_id] = _Running(queued, end, self.progress, done)
            heapq.heappush(self._ends, (self.progress + end - done, run_id))
            self._context_offset += context - self.progress
            prefill_s += self.cost.prefill_s(context * self.tokens_per_id, 0)
            self.stats.prefilled_ids += context
            self.stats.reprefilled_ids += done
        self._since += prefill_s / self.speed  # the batch waits for them meanwhile
        if self.running and not was_busy:
            self._busy_since = self.clock.now()
            self.on_busy(True)

    def _has_room(self, context: int, batch: int) -> bool:
        """Whether the cache holds `context` more ids and a step of `batch` samples."""
        return self._context() + context + batch <= self.kv_capacity_ids + 1e-9

    def _schedule(self) -> None:
        """The next event: a sample ends, the KV cache fills, or the segment's end."""
        self._epoch += 1
        if not self.running:
            return
        batch = len(self.running)
        steps = min(self._ends[0][0] - self.progress, SEGMENT_STEPS)
        if batch > 1:  # until the cache is full (at least a step: `_event` preempted for it)
            steps = min(steps, max((self.kv_capacity_ids - self._context()) / batch, 1.0))
        steps = max(steps, 0.0)
        middle = (self._context() + batch * steps / 2) * self.tokens_per_id
        step_s = self.tokens_per_id * self.cost.decode_step_s(batch, middle) / self.speed
        self._step_s, self._segment_end = step_s, self.progress + steps
        epoch = self._epoch
        self.clock.at(self._since + steps * step_s, lambda: self._event(epoch))

    def _event(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # the batch changed since: a later event stands
        self.progress, self._since = self._segment_end, self.clock.now()
        while self._ends and self._ends[0][0] <= self.progress + 1e-9:
            _, run_id = heapq.heappop(self._ends)
            self._finish(self.running.pop(run_id))
        while len(self.running) > 1 and not self._has_room(0, len(self.running)):
            self._preempt()
        self._admit()
        self._went_idle()
        self._deliver()
        self._schedule()

    def _went_idle(self) -> None:
        if not self.running and self._busy_since is not None:
            self.busy.append((self._busy_since, self.clock.now()))
            self._busy_since = None
            self.on_busy(False)

    def _take_tokens(self, run: _Running) -> int:
        """Give a leaving sample the ids it generated since it joined."""
        self._context_offset -= len(run.queued.sample.prompt_ids) + run.done - run.joined
        new = round(self.progress - run.joined)
        sample = run.queued.sample
        sample.response_ids = sample.response_ids + [0] * new
        sample.logprobs = sample.logprobs + [0.0] * new
        sample.token_versions = sample.token_versions + [self.version] * new
        self.stats.generated_ids += new
        return new

    def _finish(self, run: _Running) -> None:
        self._take_tokens(run)
        sample = run.queued.sample
        sample.finish_reason = "stop" if run.end == run.queued.length else "abort"
        key = run.queued.key
        self.unfinished[key] -= 1
        if not self.unfinished[key]:
            self.finished[key] = self.batches.pop(key)
            del self.unfinished[key]

    def _preempt(self) -> None:
        """The sample that joined last leaves the batch and waits first in the queue."""
        run_id = next(reversed(self.running))
        run = self.running.pop(run_id)
        self._ends.remove((run.joined + run.end - run.done, run_id))
        heapq.heapify(self._ends)
        self._take_tokens(run)
        self.queue.appendleft(run.queued)
        self.stats.preemptions += 1

    def _deliver(self) -> None:
        if self.waiting is not None and self.finished:
            future, self.waiting = self.waiting, None
            finished, self.finished = self.finished, {}
            self.clock.resolve(future, finished)


class SimRollout:
    """The RolloutPort over `SimEngine`s: a batch goes to the engine with the fewest samples
    in flight, as rl.cluster.rollout_replicas places it. Like every length the scheduler
    sees, stop points (partial_rollout "abort") are in ids. On time-sliced GPUs, sleeping and
    waking move the engines' weights over PCIe."""

    def __init__(self, engines: list[SimEngine], sleep_s: float) -> None:
        self.engines = engines
        self.num_workers = len(engines)
        self.sleep_s = sleep_s  # time-sliced GPUs: the weights to or from the host
        self.clock = engines[0].clock

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        loads = [(engine.load, engine.index) for engine in self.engines]
        heapq.heapify(loads)
        placed = {}
        for key, samples in batches.items():
            load, index = heapq.heappop(loads)
            self.engines[index].submit(key, samples, params.stop_every)
            heapq.heappush(loads, (load + len(samples), index))
            placed[key] = index
        return placed

    def poll(self, worker: int) -> Future:
        return self.engines[worker].poll()

    def interrupt(self) -> int:
        return sum(engine.interrupt() for engine in self.engines)

    def release_memory(self) -> None:
        """Time-sliced GPUs: the engines sleep (all at once: one engine's time)."""
        self.clock.advance(self.sleep_s)

    def reclaim_weights(self) -> None:
        self.clock.advance(self.sleep_s)

    def reclaim_memory(self) -> None: ...  # the KV cache is allocated, not copied
