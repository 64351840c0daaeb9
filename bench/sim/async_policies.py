"""What verl's and AReaL's asynchronous policies share in the simulation: a split cluster of
simulated engines and a simulated trainer (sim.engine, sim.cluster) that a policy's own
driver loop (sim.verl_async, sim.areal_async) runs instead of Tandem's scheduler, and the
measurement of a run, windowed as `sim.cluster.simulate` windows it so that rows compare.

Both systems generate a prompt's responses as one unit (verl's RolloutSample, AReaL's
rollout task), so a `Group` (a prompt and its samples) is the unit here: it is placed on
one engine, as `SimRollout` places a batch, and it is ready once all its samples stopped.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from rl.types import Sample, SamplingParams, fresh_samples
from sim.clock import SimClock
from sim.cluster import Placement, Result, SimTrainer, Workload, kv_capacity_ids, measure
from sim.costs import CostModel
from sim.engine import SimEngine, SimRollout


@dataclass
class Group:
    """One prompt's samples, generated together and trained together."""

    group_id: int  # also the order it was created in
    samples: list[Sample]
    version: int  # the policy version it started under
    resumed: int = 0  # times it was interrupted and started again

    @property
    def done(self) -> bool:
        return all(sample.finish_reason == "stop" for sample in self.samples)

    def tokens(self, tokens_per_id: int) -> int:
        return sum(len(s.response_ids) for s in self.samples) * tokens_per_id


@dataclass
class Step:
    """What one policy version cost: from one weight sync to the next."""

    start: float
    train_s: float = 0.0
    logprobs_s: float = 0.0
    groups: int = 0  # trained during it
    samples: int = 0
    tokens: int = 0
    stale_groups: int = 0  # started under older weights than those they were trained on
    resumed_groups: int = 0


class SplitCluster:
    """Simulated engines on `placement.rollout_gpus` and a trainer on the rest, with one poll
    outstanding per engine: `wait` runs the clock until groups finish or a trainer call ends."""

    def __init__(self, cost: CostModel, placement: Placement, workload: Workload) -> None:
        if placement.kind != "split":
            raise ValueError(
                f"an asynchronous policy runs rollout and trainer on their own GPUs, "
                f"not on a {placement.kind!r} placement"
            )
        self.cost, self.placement, self.workload = cost, placement, workload
        self.tpi = tpi = workload.tokens_per_id
        self.clock = SimClock()
        capacity = kv_capacity_ids(cost, workload)
        num_engines = placement.rollout_gpus // cost.model.tp
        assert num_engines >= 1, (placement, cost.model.tp)
        self.engines = [
            SimEngine(i, self.clock, cost, workload.length, capacity, tpi)
            for i in range(num_engines)
        ]
        self.rollout = SimRollout(self.engines, sleep_s=0.0)
        self.trainer = SimTrainer(
            self.clock, cost, placement, self.rollout, tpi, needs_annotation=False,
            keeps_pushed_weights=True,
        )  # fmt: skip
        self.params = SamplingParams(
            n=workload.group_size, max_new_tokens=workload.max_tokens // tpi
        )
        self.prompt = [1] * (workload.prompt_tokens // tpi)
        self.version = 0  # weight syncs done
        self.in_flight: dict[int, Group] = {}
        self.step = Step(start=0.0)
        self.steps: list[dict[str, float]] = []
        self.ends: list[float] = []  # when each version's sync ended
        self._call: tuple[Future, str, float] | None = None  # the trainer's call, its kind, start
        self._polls = {engine.index: engine.poll() for engine in self.engines}
        self._next_id = 0

    def new_group(self) -> Group:
        group_id, self._next_id = self._next_id, self._next_id + 1
        samples = fresh_samples([self.prompt], self.workload.group_size, [group_id])
        return Group(group_id, samples, self.version)

    def start(self, group: Group) -> None:
        """Generate what the group lacks: after an interrupt, its unfinished samples resume
        with their prefixes (prefilled again: the old version's KV cache is gone)."""
        todo = [s for s in group.samples if s.finish_reason != "stop"]
        assert todo and group.group_id not in self.in_flight, group.group_id
        self.in_flight[group.group_id] = group
        self.rollout.submit({group.group_id: todo}, self.params)

    @property
    def training(self) -> bool:
        """Whether a trainer call is running."""
        return self._call is not None

    def wait(self) -> tuple[list[Group], list[Group], str | None]:
        """Run until groups come back or the trainer's call ends: (finished groups in the
        order they finished, interrupted groups, the kind of call that ended or None)."""
        awaited = list(self._polls.values()) + ([self._call[0]] if self._call else [])
        done = self.clock.wait_first(awaited)
        finished, interrupted = self._collect(done)
        ended = None
        if self._call is not None and self._call[0] in done:
            _, ended, start = self._call
            self._call = None
            seconds = self.clock.now() - start
            if ended == "train":
                self.step.train_s += seconds
            else:
                self.step.logprobs_s += seconds
        return finished, interrupted, ended

    def interrupt(self) -> tuple[list[Group], list[Group]]:
        """Abort every sample in flight where it is (verl's partial rollout, AReaL's
        interruptible generation): (groups that had just finished, interrupted groups)."""
        if not self.rollout.interrupt():
            return [], []
        done = {future for future in self._polls.values() if future.done()}
        finished, interrupted = self._collect(self.clock.wait_first(list(done)))
        assert not self.in_flight, sorted(self.in_flight)
        return finished, interrupted

    def drain(self) -> list[Group]:
        """Run until every group in flight has finished (a sync without partial rollout)."""
        finished: list[Group] = []
        while self.in_flight:
            more, interrupted, _ = self.wait()
            assert not interrupted
            finished += more
        return finished

    def _collect(self, done: set[Future]) -> tuple[list[Group], list[Group]]:
        finished, interrupted = [], []
        for index, future in sorted(self._polls.items()):
            if future not in done:
                continue
            for group_id in future.result():
                group = self.in_flight.pop(group_id)
                if group.done:
                    finished.append(group)
                else:
                    group.resumed += 1
                    interrupted.append(group)
            self._polls[index] = self.engines[index].poll()
        return finished, interrupted

    def annotate(self, groups: list[Group]) -> None:
        """Log-probs of the groups under the trainer's current weights (AReaL's proximal
        policy): a forward pass on the trainer."""
        assert self._call is None, "the trainer runs one call at a time"
        future = self.trainer.annotate([s for g in groups for s in g.samples])
        self._call = (future, "annotate", self.clock.now())

    def train(self, groups: list[Group]) -> None:
        """A forward and backward pass over the groups, and the optimizer's steps."""
        assert self._call is None, "the trainer runs one call at a time"
        samples = [s for g in groups for s in g.samples]
        future = self.trainer.train(self.version + 1, samples, [0.0] * len(samples))
        self._call = (future, "train", self.clock.now())
        step = self.step
        step.groups += len(groups)
        step.samples += len(samples)
        step.tokens += sum(g.tokens(self.tpi) for g in groups)
        step.stale_groups += sum(1 for g in groups if g.version < self.version)
        step.resumed_groups += sum(1 for g in groups if g.resumed)

    def push(self) -> None:
        """A weight sync: the trainer's weights to every engine, the version one up; it ends
        the version's step."""
        assert self._call is None, "a sync waits for the trainer's call"
        self.version += 1
        self.trainer.push(self.version)
        now, step = self.clock.now(), self.step
        seconds = now - step.start
        self.steps.append({
            "time/step_s": seconds,
            "rollout/kept_groups": step.groups,
            "rollout/tokens": step.tokens,
            "response/mean_tokens": step.tokens / max(1, step.samples),
            "rollout/stale_groups": step.stale_groups,
            "rollout/resumed_groups": step.resumed_groups,
            "perf/busy_s_train": step.train_s,
            "perf/busy_s_logprobs": step.logprobs_s,
            # waiting for samples to train on (verl's "gen" of a fully-async step)
            "perf/wait_s": seconds - step.train_s - step.logprobs_s,
        })  # fmt: skip
        self.ends.append(now)
        self.step = Step(start=now)

    def result(self) -> Result:
        """The run's measurement in the steady state, as `sim.cluster.simulate` measures
        Tandem's."""
        return measure(
            self.steps, self.ends, self.cost, self.placement, self.engines, self.trainer, 0
        )
