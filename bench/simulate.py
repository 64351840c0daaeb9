"""The real scheduler (rl.run.scheduler.loop) on a simulated clock: simulated rollout engines,
trainer and scorer behind its ports, so that its admission, overlap and sync decisions play
out at a cluster's scale in seconds (issue 35).

    .venv/bin/python bench/simulate.py [--steps 8] [--k 0,1,2]

The clock (`SimClock`) jumps from one event to the next and never sleeps. The costs:
- an engine batches continuously: every running sample gains a token per decode step, and a
  step takes `decode_s(batch)` = a fixed cost plus a cost per running sample; a sample's
  prompt costs `prefill_s_per_token` per token when it joins;
- a train step costs 6 x parameters x tokens / (GPUs x peak x MFU), an annotation a third
  of that (forward only);
- a weight sync costs bytes / bandwidth plus a fixed latency;
- response lengths come from a long-tailed distribution, fixed per sample by its ids.

This first cut runs partial_rollout "finish" and "abort" (not the timing-dependent
"interrupt") and no lost workers; the sweeps, the cost model's published figures and the
calibration against verl's fully-async runs are issue 35's next steps.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from rl.observe.trace import Trace
from rl.run.scheduler.loop import Scheduler
from rl.run.scheduler.ports import Settings
from rl.types import Sample, SamplingParams, fresh_samples


class SimClock:
    """Simulated seconds. `at(when, action)` runs `action` once the clock reaches `when`;
    `wait_first` runs the actions in time order until one of the awaited futures is done."""

    def __init__(self) -> None:
        self.time = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled

    def now(self) -> float:
        return self.time

    def at(self, when: float, action: Callable[[], None]) -> None:
        assert when >= self.time, (when, self.time)
        heapq.heappush(self._events, (when, next(self._order), action))

    def wait_first(self, futures: list[Future]) -> set[Future]:
        while not any(future.done() for future in futures):
            assert self._events, "waiting on futures nothing will complete"
            self.time, _, action = heapq.heappop(self._events)
            action()
        return {future for future in futures if future.done()}

    def advance(self, seconds: float) -> None:
        """A blocking call of `seconds` (a weight sync): nothing else may be due meanwhile."""
        assert not self._events or self._events[0][0] >= self.time + seconds, "events overlap"
        self.time += seconds


def done(result: object) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


@dataclass
class CostModel:
    """Seconds of each kind of work (the module docstring)."""

    decode_base_s: float = 0.02  # an engine's decode step, whatever its batch
    decode_per_seq_s: float = 1e-4  # and per running sample
    prefill_s_per_token: float = 1e-5
    params: float = 7e9
    trainer_gpus: int = 8
    gpu_flops: float = 989e12  # H100 bf16 dense
    mfu: float = 0.4
    sync_bytes_per_s: float = 100e9
    sync_latency_s: float = 0.5
    wire_bytes: int = 2  # bf16

    def decode_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def train_s(self, tokens: int) -> float:
        return 6 * self.params * tokens / (self.trainer_gpus * self.gpu_flops * self.mfu)

    def sync_s(self) -> float:
        return self.wire_bytes * self.params / self.sync_bytes_per_s + self.sync_latency_s


def long_tailed_length(sample: Sample, median: int, sigma: float, cap: int) -> int:
    """A log-normal response length, fixed by the sample's ids (as a seeded engine's is)."""
    rng = random.Random(sample.group_id * 1_000_003 + sample.index)
    return max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0, 1)))))


@dataclass
class _Running:
    key: int
    sample: Sample
    end: int  # the length it stops at: its own end, or an abort point before it
    remaining: float  # tokens still to generate until `end`


@dataclass
class SimEngine:
    """One rollout engine batching continuously (CostModel.decode_s)."""

    index: int
    clock: SimClock
    cost: CostModel
    length: Callable[[Sample], int]
    version: int = 0
    running: list[_Running] = field(default_factory=list)
    batches: dict[int, list[Sample]] = field(default_factory=dict)  # key -> samples
    unfinished: dict[int, int] = field(default_factory=dict)  # key -> samples still running
    finished: dict[int, list[Sample]] = field(default_factory=dict)
    waiting: Future | None = None  # the outstanding poll
    _since: float = 0.0  # when `running` last advanced
    _epoch: int = 0  # invalidates the finish event scheduled for an older batch

    def submit(self, key: int, samples: list[Sample], stop_every: int = 0) -> None:
        """Start `samples` (fresh, or partial ones resuming after their prefix). With
        `stop_every`, each stops partial once its length reaches the next multiple of it
        (partial_rollout "abort"), unless it ends first."""
        self._advance()
        prefill = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        self._since += prefill * self.cost.prefill_s_per_token  # the batch stalls meanwhile
        self.batches[key], self.unfinished[key] = samples, len(samples)
        for sample in samples:
            done, end = len(sample.response_ids), self.length(sample)
            if stop_every:
                end = min(end, (done // stop_every + 1) * stop_every)
            self.running.append(_Running(key, sample, end, end - done))
        self._schedule()

    def poll(self) -> Future:
        assert self.waiting is None
        self.waiting = Future()
        self._deliver()
        return self.waiting

    def _advance(self) -> None:
        """Every running sample gains the tokens of the decode steps since `_since`."""
        now = self.clock.now()
        if self.running and now > self._since:
            steps = (now - self._since) / self.cost.decode_s(len(self.running))
            for run in self.running:
                run.remaining -= steps
        self._since = max(self._since, now)

    def _schedule(self) -> None:
        self._epoch += 1
        if self.running:
            first = min(run.remaining for run in self.running)
            when = self._since + max(first, 0.0) * self.cost.decode_s(len(self.running))
            epoch = self._epoch
            self.clock.at(when, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # the batch changed since: a later event stands
        self._advance()
        done_now = [run for run in self.running if run.remaining <= 1e-9]
        self.running = [run for run in self.running if run.remaining > 1e-9]
        for run in done_now:
            new = run.end - len(run.sample.response_ids)
            run.sample.response_ids = run.sample.response_ids + [0] * new
            run.sample.logprobs = run.sample.logprobs + [0.0] * new
            run.sample.token_versions = run.sample.token_versions + [self.version] * new
            ended = run.end == self.length(run.sample)
            run.sample.finish_reason = "stop" if ended else "abort"
            self.unfinished[run.key] -= 1
            if not self.unfinished[run.key]:
                self.finished[run.key] = self.batches.pop(run.key)
                del self.unfinished[run.key]
        self._deliver()
        self._schedule()

    def _deliver(self) -> None:
        if self.waiting is not None and self.finished:
            future, self.waiting = self.waiting, None
            finished, self.finished = self.finished, {}
            future.set_result(finished)


class SimRollout:
    """The RolloutPort over `SimEngine`s: a batch goes to the engine with the fewest running."""

    def __init__(self, engines: list[SimEngine]) -> None:
        self.engines = engines
        self.num_workers = len(engines)

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        placed = {}
        for key, samples in batches.items():
            engine = min(self.engines, key=lambda e: (len(e.running), e.index))
            engine.submit(key, samples, params.stop_every)
            placed[key] = engine.index
        return placed

    def poll(self, worker: int) -> Future:
        return self.engines[worker].poll()

    def interrupt(self) -> int:
        raise NotImplementedError("partial_rollout 'interrupt' (timing-dependent) is not simulated")

    def release_memory(self) -> None: ...

    def reclaim_weights(self) -> None: ...

    def reclaim_memory(self) -> None: ...


class SimTrainer:
    """The TrainerPort: a step costs CostModel.train_s of its tokens; a push, sync_s."""

    needs_annotation = False

    def __init__(self, clock: SimClock, cost: CostModel, rollout: SimRollout, k: int) -> None:
        self.clock, self.cost, self.rollout = clock, cost, rollout
        self.keeps_pushed_weights = k >= 1

    def train(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        future: Future = Future()
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        self.clock.at(self.clock.now() + self.cost.train_s(tokens), lambda: future.set_result({}))
        return future

    def annotate(self, samples: list[Sample]) -> Future:
        raise NotImplementedError

    def release_memory(self) -> None: ...

    def push(self, version: int) -> dict[str, float]:
        self.clock.advance(self.cost.sync_s())
        for engine in self.rollout.engines:
            engine.version = version
        return {}

    def replace_rollout_worker(self, worker: int, version: int) -> None:
        raise NotImplementedError("lost workers are not simulated")


class SimScorer:
    """Rewards cost nothing here. A sample is right with probability `accuracy`, fixed by its
    ids: groups all right or all wrong are what dynamic sampling drops."""

    def __init__(self, accuracy: float) -> None:
        self.accuracy = accuracy

    def score(self, groups: list[tuple[list[Sample], dict]]) -> Future:
        def right(sample: Sample) -> float:
            draw = random.Random(sample.group_id * 7919 + sample.index).random()
            return float(draw < self.accuracy)

        return done(([[right(s) for s in samples] for samples, _ in groups], {}))


@dataclass(frozen=True)
class Workload:
    num_steps: int = 8
    groups_per_step: int = 32
    group_size: int = 8
    prompt_tokens: int = 512
    median_tokens: int = 1500
    sigma: float = 1.0  # log-normal spread: a few responses many times the median
    max_tokens: int = 16384
    num_engines: int = 4
    accuracy: float = 0.5  # the chance a sample is right


def simulate(
    workload: Workload,
    cost: CostModel,
    k: int,
    abort_every: int = 0,
    dynamic_sampling_rounds: int = 0,
) -> list[dict[str, float]]:
    """Run the real scheduler over `workload` at max_staleness `k`, with partial_rollout
    "abort" at every `abort_every` tokens (0: "finish"), and with dynamic sampling drawing up
    to `dynamic_sampling_rounds` times a step's groups (0: off); each step's metrics."""
    clock = SimClock()
    rollout = SimRollout(
        [
            SimEngine(
                i,
                clock,
                cost,
                lambda s: long_tailed_length(
                    s, workload.median_tokens, workload.sigma, workload.max_tokens
                ),
            )
            for i in range(workload.num_engines)
        ]
    )
    settings = Settings(
        num_steps=workload.num_steps,
        groups_per_step=workload.groups_per_step,
        group_size=workload.group_size,
        max_staleness=k,
        partial_rollout="abort" if abort_every else "finish",
        abort_every=abort_every,
        dynamic_sampling=dynamic_sampling_rounds > 0,
        max_groups_per_step=max(1, dynamic_sampling_rounds) * workload.groups_per_step,
        release_memory=False,
        max_rollout_restarts=0,
    )
    lanes = {f"rollout-{i}": [i] for i in range(workload.num_engines)}
    trace = Trace({**lanes, "trainer": [workload.num_engines], "reward": []}, clock=clock.now)

    def next_group(group_id: int) -> tuple[dict, list[Sample]]:
        prompt = [1] * workload.prompt_tokens
        return {}, fresh_samples([prompt], workload.group_size, [group_id])

    scheduler = Scheduler(
        settings,
        SamplingParams(n=workload.group_size, max_new_tokens=workload.max_tokens),
        rollout,
        SimTrainer(clock, cost, rollout, k),
        SimScorer(workload.accuracy),
        next_group,
        trace,
        clock=clock,
    )
    return [metrics for _, metrics in scheduler.run()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--k", default="0,1,2")
    parser.add_argument("--abort-every", type=int, default=512)
    args = parser.parse_args()
    workload = Workload(num_steps=args.steps)
    print("| k | partial rollouts | steps/hour (simulated) | mean step s | staleness max |")
    print("|---:|---|---:|---:|---:|")
    for k in map(int, args.k.split(",")):
        for abort_every in (0, args.abort_every) if k else (0,):
            steps = simulate(workload, CostModel(), k, abort_every)
            seconds = [m["time/step_s"] for m in steps]
            mode = f"abort every {abort_every}" if abort_every else "finish"
            print(
                f"| {k} | {mode} | {3600 * len(seconds) / sum(seconds):.1f} | "
                f"{sum(seconds) / len(seconds):.1f} | "
                f"{max(m['rollout/staleness_max'] for m in steps):.0f} |"
            )


if __name__ == "__main__":
    main()
